"""Source of the user model the tests share: written to a file, imported as ``module:make``.

It is not an ``nn.Sequential``, so it is traced with torch.fx, and fc1's output ``h`` skips
over fc2 and fc3 to be added back before the last layer: the cut after fc2 carries
``relu(fc2(h))`` *and* ``h``. Input width 8, 4 classes.
"""

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpipe_plan.models import model_spec


def user_module_dir(tmp_path_factory: pytest.TempPathFactory, module: str, source: str) -> Path:
    """A fresh folder holding the user's module ``module``.py (``source``, dedented); ranks start
    there and import from it. Name the module apart from other test files' modules: the pytest
    process keeps imported modules by name, so a second file's ``task`` would find the first's."""
    folder = tmp_path_factory.mktemp(module)
    (folder / f"{module}.py").write_text(textwrap.dedent(source))
    return folder


def spec_in(folder: Path, factory: str, **options: Any) -> dict[str, Any]:
    """``model_spec(factory, **options)`` as made in ``folder``, where the factory's module lives."""
    old = os.getcwd()
    os.chdir(folder)
    try:
        return model_spec(factory, **options)
    finally:
        os.chdir(old)


SKIP_NET = """
    import torch
    from torch import nn

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 16)
            self.fc3 = nn.Linear(16, 16)
            self.out = nn.Linear(16, 4)

        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            y = torch.relu(self.fc2(h))
            z = self.fc3(y)
            return self.out(z + h)

    def make():
        return Skip()
"""
SKIP_NET_INPUTS = 8
SKIP_NET_CLASSES = 4


# A user's --data and --loss for the models above: 4 classes of a fixed random linear map of 8
# inputs (the teacher drawn from torch's seeded generator, so every rank draws the same one).
TEACHER_DATA_AND_LOSS = """
    import torch
    import torch.nn.functional as F

    def data(batch_size):
        teacher = torch.randn(8, 4)
        while True:
            x = torch.randn(batch_size, 8)
            yield x, (x @ teacher).argmax(dim=1)

    def loss(outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=0.1)
"""
