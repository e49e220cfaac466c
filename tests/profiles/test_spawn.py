"""The helper processes of a measurement (profiles/spawn.py): what they put comes back, however
much it is, and a failed or stuck helper ends the measurement with one line, not a hang."""

from __future__ import annotations

import pytest

from gpipe_plan.profiles.spawn import run_workers

BIG = 1 << 20     # far more than a pipe holds (64 KiB on Linux)


def put_payload(rank: int, size: int, results) -> None:
    results.put((rank, b"x" * size))


def fail(rank: int, results) -> None:
    raise SystemExit(3)


def test_what_the_workers_put_comes_back_however_much_it_is() -> None:
    # Read while they run: a parent that read only once they ended would leave them blocked on the
    # full pipe until the deadline, where run_workers kills them and raises (so no wall-clock check
    # is needed here; the deadline only leaves room to start two interpreters on a loaded host).
    out = sorted(run_workers(put_payload, 2, (BIG,), 30.0, "putting a megabyte each"))
    assert [(rank, len(payload)) for rank, payload in out] == [(0, BIG), (1, BIG)]


def test_a_failed_worker_is_one_error_naming_what_they_did() -> None:
    with pytest.raises(RuntimeError, match=r"the 1 process failing on purpose failed \(exit code \[3\]\)"):
        run_workers(fail, 1, (), 60.0, "failing on purpose")
