"""The torch executor on the torch that is installed, not only the one we develop with.

The GPU machine's image ships torch 2.11, whose ``PipelineStage`` takes no gradient metadata
(``output_grads``, ``input_grads`` arrived in 2.13); passing them there is a TypeError on the
first CUDA run. These tests give the executor classes with the signatures of older releases
(copied from their sources) and check what it passes and what it refuses.
"""

from __future__ import annotations

import pytest
import torch

from gpipe_plan.artifacts import BadInput
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.runtime.handplan import hand_plan
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.stage import build_stage
from gpipe_plan.runtime.torch_executor import pipelining_features, stage_arguments
from gpipe_plan.artifacts import write_json_atomic

GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)


class Stage211:
    """``torch.distributed.pipelining.PipelineStage.__init__`` as torch 2.11 has it."""

    def __init__(self, submodule, stage_index, num_stages, device, input_args=None, output_args=None,  # noqa: ANN001
                 group=None, dw_builder=None) -> None: ...


class Schedule211:
    """``Schedule1F1B`` of torch 2.11 (the same as 2.13's for what we use)."""

    def __init__(self, stage, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,  # noqa: ANN001
                 output_merge_spec=None, scale_grads=True) -> None: ...

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs) -> None: ...  # noqa: ANN001, ANN002, ANN003


class Schedule24:
    """``Schedule1F1B`` of torch 2.4: no ``scale_grads`` (it summed the micro-batches' gradients)."""

    def __init__(self, stage, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,  # noqa: ANN001
                 output_merge_spec=None) -> None: ...

    def step(self, *args, target=None, losses=None, **kwargs) -> None: ...  # noqa: ANN001, ANN002, ANN003


@pytest.fixture
def two_stages(tmp_path):  # noqa: ANN001, ANN201
    """Both stages of a 2-stage gpt plan: the first receives activations from no one, the last
    receives no gradients."""
    write_json_atomic(tmp_path / "plan.json", hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2))
    plan = load_plan(tmp_path / "plan.json")
    return [build_stage(build_model(GPT), plan, k) for k in range(2)]


def test_the_installed_torch_is_read_as_it_is(two_stages) -> None:  # noqa: ANN001
    """2.13 takes the gradients' metadata and gets it for the cuts that have one; 2.11 (the GPU
    image's) takes none and gets none; both have what every run needs."""
    features = pipelining_features()
    assert features.static_shapes and features.scale_grads and features.losses
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 13):
        assert features.grad_metas
        first, last = (stage_arguments(s, torch.device("cpu"), features) for s in two_stages)
        assert first["output_grads"] is not None and first["input_grads"] is None
        assert last["output_grads"] is None and last["input_grads"] is not None
    elif version <= (2, 11):
        assert not features.grad_metas
        assert all(set(stage_arguments(s, torch.device("cpu"), features)) == {"input_args", "output_args"}
                   for s in two_stages)


def test_torch_2_11_gets_no_gradient_metadata(two_stages) -> None:  # noqa: ANN001
    features = pipelining_features(Stage211, Schedule211)
    assert features.static_shapes and not features.grad_metas and features.scale_grads and features.losses
    for stage in two_stages:
        arguments = stage_arguments(stage, torch.device("cpu"), features)
        assert set(arguments) == {"input_args", "output_args"}
        Stage211(stage.module, stage.index, 2, torch.device("cpu"), **arguments)  # what the executor will call
    received = stage_arguments(two_stages[1], torch.device("cpu"), features)["input_args"]
    assert all(x.requires_grad for x in received)   # the last stage's inputs are leaves needing gradients


def test_a_torch_without_scale_grads_is_refused_in_one_line(two_stages) -> None:  # noqa: ANN001
    features = pipelining_features(Stage211, Schedule24)
    assert not features.scale_grads and not features.losses
    with pytest.raises(BadInput) as caught:
        stage_arguments(two_stages[0], torch.device("cpu"), features)
    message = str(caught.value)
    assert "\n" not in message and "lacks Schedule1F1B(scale_grads=)" in message and "--executor native" in message
