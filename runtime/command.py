"""``gpipe-plan run``: check everything cheap, then start the ranks (or be one, under torchrun)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from ..allocator import steady_allocator
from .checkpoint_dir import claim
from .conditions import threads_per_rank
from ..artifacts import BadInput
from .options import RunOptions, async_problem, check_options
from .plan import check_precision_matches, check_sync_matches, load_plan
from .trust import imports_note


def run_command(plan: str, **options: Any) -> None:
    """Train with PLAN. Raises BadInput (exit 2) or RunFailure (exit 1)."""
    steady_allocator()       # as profile allocated (allocator.py), in the ranks it starts too
    opts = check_options(RunOptions(plan=plan, **options))
    run_plan = load_plan(opts.plan)  # a bad plan fails here, before any process starts
    opts.optimizer_name(run_plan.optimizer)     # (refuses a --momentum it would not read)
    compute, _ = check_precision_matches(run_plan, opts.precision, opts.param_dtype)
    check_sync_matches(run_plan, opts.grad_clip)
    reason = async_problem(opts, run_plan.schedule, compute, run_plan.gradient_sync,
                           any(chunk.recompute for chunk in run_plan.chunks))
    if reason:
        raise BadInput(reason)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if opts.warmup_steps > opts.steps and (not under_torchrun or os.environ["RANK"] == "0"):
        # Not refused: a short try of a long run's recipe is fair; but the rate it trains at is said.
        print(f"warning: --warmup-steps {opts.warmup_steps} is more than --steps {opts.steps}: the learning rate "
              f"never reaches --lr (it ends at {100 * opts.steps / opts.warmup_steps:.2g}% of it)",
              file=sys.stderr, flush=True)
    note = imports_note(run_plan.model, opts.data)
    if note and (not under_torchrun or os.environ["RANK"] == "0"):
        print(note, file=sys.stderr, flush=True)   # before any rank imports it (runtime/trust.py)
    # The one run writing the checkpoint folder, until this process ends (runtime/checkpoint_dir.py):
    # the launcher, or rank 0 under torchrun.
    held = claim(Path(opts.checkpoint_dir), resume=opts.resume) \
        if opts.checkpoint_dir is not None and (not under_torchrun or os.environ["RANK"] == "0") else None
    try:
        if under_torchrun:
            # Started by torchrun: this process is one rank. Say failures ourselves and exit at
            # once (a rank whose peers are gone must not wait for them at shutdown).
            from .worker import run_rank

            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            status = run_rank(opts)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        from .launch import launch_local

        # One process per stage of each replica: K·d ranks on this machine, the cores shared among them.
        threads = threads_per_rank(opts.threads, run_plan, run_plan.world_size)
        launch_local(opts, run_plan.world_size, threads)
    finally:
        if held is not None:
            held.release()
