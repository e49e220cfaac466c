"""The profiler: measure a model layer by layer and write a profile JSON.

``gpipe-plan profile`` calls :func:`profile_command`. The measuring itself lives in
:mod:`.profiler` (and the modules it uses); :mod:`.show` pretty-prints a profile.

Importing this package stays cheap and imports no torch: ``gpipe-plan show`` uses
:mod:`.show` to print a profile without paying torch's start-up.
"""

from __future__ import annotations

from typing import Any


def profile_command(**options: Any) -> None:
    """Run ``gpipe-plan profile`` with the CLI's options (see :mod:`.command`)."""
    import warnings

    # torch warns at import when NumPy is absent; the profiler does not use NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from .command import profile_command as run

    run(**options)
