"""The options of ``gpipe-plan run``, checked in the launching process before any rank starts.

Each is declared once, with its flag, default and help (gpipe_plan/options.py): the command
line is generated from :class:`RunOptions`. The launcher hands them to every rank as JSON (an
environment variable), so they are plain values. No torch here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import PARAM_DTYPES, PRECISIONS, BadInput, check_output_paths
from ..options import check_seed, option

OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-2, "momentum": 1e-2}
# Options that mean something only beside another take None as "not given", so that one given
# alone is refused (check_options) instead of doing nothing; these are their values.
DEFAULT_MOMENTUM = 0.9
DEFAULT_CHECKPOINT_EVERY = 100
DEFAULT_KEEP_CHECKPOINTS = 2
LR_SCHEDULES = ("constant", "cosine")
EXECUTORS = ("auto", "native", "torch")
DEVICES = ("auto", "cpu", "cuda")
ENV = "GPIPE_PLAN_RUN_OPTIONS"
# The longest --timeout: the process group's timeout is a timedelta, and a stuck rank must be
# found some day (inf would overflow it after the whole set-up, not at the command line).
MAX_TIMEOUT_S = 1e6


@dataclass(frozen=True)
class RunOptions:
    """``gpipe-plan run``'s options, each declared once (gpipe_plan/options.py): flag, default, help."""

    plan: str
    steps: int = option("--steps", default=20, type=int, show_default=True,
                        help="Training steps to run in all (a resumed run continues up to this count).")
    seed: int = option("--seed", default=0, type=int, show_default=True,
                       help="Seed of the initial parameters (the same on every rank) and of the data.")
    optimizer: str | None = option("--optimizer", choices=OPTIMIZERS,
                                   help="Optimizer. Default: the one the plan's memory model counted, else adam.")
    lr: float | None = option("--lr", type=float,
                              help="Learning rate. Default: 1e-3 for adam/adamw, 1e-2 for sgd/momentum.")
    weight_decay: float = option("--weight-decay", default=0.0, type=float, show_default=True, help="Weight decay.")
    momentum: float | None = option("--momentum", type=float,
                                    help=f"Momentum of --optimizer momentum. Default: {DEFAULT_MOMENTUM}.")
    grad_clip: float | None = option("--grad-clip", type=float, metavar="NORM",
                                     help="Clip the global gradient norm (over all stages) to NORM.")
    lr_schedule: str = option("--lr-schedule", default="constant", choices=LR_SCHEDULES, show_default=True,
                              help="Learning-rate schedule after the warm-up; cosine decays to lr/10 at the last "
                                   "step.")
    warmup_steps: int = option("--warmup-steps", default=0, type=int, show_default=True,
                               help="Linear learning-rate warm-up steps.")
    data: str | None = option("--data", metavar="FILE.txt|pkg.module:factory",
                              help="A language model (gpt, or yours with --loss lm): train on this text, byte-level "
                                   "(vocabulary >= 256). Your model: factory(batch_size) yields (inputs, targets) "
                                   "mini-batches. Default: the profile's --data factory, else synthetic data.")
    save: str | None = option("--save", path="file", metavar="model.pt",
                              help="Write the trained model's full state_dict (the unsplit model's keys), for "
                                   "torch.load.")
    report: str | None = option("--report", path="file", metavar="report.json",
                                help="Write measured vs predicted (step time, per-stage times, memory, bubble) as "
                                     "JSON.")
    trace: str | None = option("--trace", path="file", metavar="trace.json",
                               help="Write a Chrome trace of every stage's forwards and backwards (open in "
                                    "ui.perfetto.dev).")
    checkpoint_dir: str | None = option("--checkpoint-dir", path="dir",
                                        help="Save checkpoints here, every --checkpoint-every steps and at the end: "
                                             "one torch.distributed.checkpoint per step, keyed like the unsplit "
                                             "model (all ranks must see it).")
    checkpoint_every: int | None = option("--checkpoint-every", type=int,
                                          help=f"With --checkpoint-dir: steps between checkpoints. Default: "
                                               f"{DEFAULT_CHECKPOINT_EVERY}.")
    keep_checkpoints: int | None = option("--keep-checkpoints", type=int,
                                          help=f"With --checkpoint-dir: newest checkpoints to keep. Default: "
                                               f"{DEFAULT_KEEP_CHECKPOINTS}.")
    resume: bool = option("--resume", default=False, is_flag=True,
                          help="Continue from the newest complete checkpoint in --checkpoint-dir (start fresh if "
                               "there is none), under this plan or any other split of the same model (other stages, "
                               "balance, batch).")
    init_from: str | None = option("--init-from", path="file", metavar="FILE",
                                   help="Start from these weights of the unsplit model: a torch.save'd state_dict "
                                        "(.pt, .bin) or a .safetensors file, keyed like model.state_dict() (as --save "
                                        "writes it); each rank reads only its stage's tensors. The optimizer starts "
                                        "fresh, at step 0. With --resume, an existing checkpoint wins.")
    precision: str | None = option("--precision", choices=PRECISIONS,
                                   help="Compute dtype (fp16 adds loss scaling). Default: the plan's; a different "
                                        "one is refused, since the plan's times and memory were measured in its own.")
    param_dtype: str | None = option("--param-dtype", choices=PARAM_DTYPES,
                                     help="Dtype of the parameters, gradients and optimizer state. Default: the "
                                          "plan's.")
    executor: str = option("--executor", default="auto", choices=EXECUTORS, show_default=True,
                           help="native: gpipe-plan's executor (gloo/CPU); torch: torch.distributed.pipelining; "
                                "auto: native on CPU, torch on CUDA.")
    device: str = option("--device", default="auto", choices=DEVICES, show_default=True,
                         help="Where ranks run: cuda is one GPU per rank (cuda:LOCAL_RANK); auto follows the plan's "
                              "profile.")
    threads: int | None = option("--threads", type=int,
                                 help="CPU threads per rank. Default: the threads the plan's profile measured with.")
    timeout: float = option("--timeout", default=60.0, type=float, show_default=True,
                            help="Seconds a rank may go without progress (waiting for a neighbour or a "
                                 "collective, reading its data, an action, a checkpoint write) before the run "
                                 "stops as stuck.")
    log_every: int = option("--log-every", default=10, type=int, show_default=True,
                            help="When the output is not a terminal: print a progress line every N steps.")
    quiet: bool = option("--quiet", "-q", default=False, is_flag=True,
                         help="No progress line or table (errors and warnings still show).")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunOptions":
        return cls(**json.loads(text))

    def optimizer_name(self, plan_optimizer: str | None) -> str:
        """The optimizer the run steps: --optimizer, else the plan's, else adam. Refuses a
        --momentum that it would not read."""
        name = self.optimizer or (plan_optimizer if plan_optimizer in OPTIMIZERS else "adam")
        if self.momentum is not None and name != "momentum":
            raise BadInput(f"--momentum is --optimizer momentum's, and this run steps {name}: give --optimizer "
                           "momentum, or leave --momentum out")
        return name

    def learning_rate(self, optimizer: str) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[optimizer]

    @property
    def momentum_factor(self) -> float:
        return self.momentum if self.momentum is not None else DEFAULT_MOMENTUM

    @property
    def steps_between_checkpoints(self) -> int:
        return self.checkpoint_every if self.checkpoint_every is not None else DEFAULT_CHECKPOINT_EVERY

    @property
    def checkpoints_kept(self) -> int:
        return self.keep_checkpoints if self.keep_checkpoints is not None else DEFAULT_KEEP_CHECKPOINTS


def check_options(options: RunOptions) -> RunOptions:
    """Refuse what cannot work, in one line each; make paths absolute (ranks may cd)."""
    if options.steps < 1:
        raise BadInput(f"--steps must be at least 1, got {options.steps}")
    check_seed(options.seed)
    if options.optimizer is not None and options.optimizer not in OPTIMIZERS:
        raise BadInput(f"--optimizer '{options.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
    if options.lr is not None and not (math.isfinite(options.lr) and options.lr > 0):
        raise BadInput(f"--lr must be a positive number, got {options.lr}")
    if not options.weight_decay >= 0:
        raise BadInput(f"--weight-decay must be >= 0, got {options.weight_decay}")
    if options.momentum is not None and not 0 <= options.momentum < 1:
        raise BadInput(f"--momentum must be in [0, 1), got {options.momentum}")
    if options.grad_clip is not None and not options.grad_clip > 0:
        raise BadInput(f"--grad-clip must be positive, got {options.grad_clip}")
    if options.lr_schedule not in LR_SCHEDULES:
        raise BadInput(f"--lr-schedule '{options.lr_schedule}' is not one of {', '.join(LR_SCHEDULES)}")
    if options.warmup_steps < 0:
        raise BadInput(f"--warmup-steps must be >= 0, got {options.warmup_steps}")
    if options.checkpoint_every is not None and options.checkpoint_every < 1:
        raise BadInput(f"--checkpoint-every must be at least 1, got {options.checkpoint_every}")
    if options.keep_checkpoints is not None and options.keep_checkpoints < 1:
        raise BadInput(f"--keep-checkpoints must be at least 1, got {options.keep_checkpoints}")
    for flag, value in (("--checkpoint-every", options.checkpoint_every),
                        ("--keep-checkpoints", options.keep_checkpoints)):
        if value is not None and not options.checkpoint_dir:
            raise BadInput(f"{flag} says how the run checkpoints, and it saves none without --checkpoint-dir: give "
                           f"--checkpoint-dir FOLDER too, or leave {flag} out")
    if options.resume and not options.checkpoint_dir:
        raise BadInput("--resume needs --checkpoint-dir: the folder the run saved its checkpoints in")
    if options.precision is not None and options.precision not in PRECISIONS:
        raise BadInput(f"--precision '{options.precision}' is not one of {', '.join(PRECISIONS)}")
    if options.param_dtype is not None and options.param_dtype not in PARAM_DTYPES:
        raise BadInput(f"--param-dtype '{options.param_dtype}' is not one of {', '.join(PARAM_DTYPES)}")
    if options.executor not in EXECUTORS:
        raise BadInput(f"--executor '{options.executor}' is not one of {', '.join(EXECUTORS)}")
    if options.device not in DEVICES:
        raise BadInput(f"--device '{options.device}' is not one of {', '.join(DEVICES)}")
    if options.threads is not None and options.threads < 1:
        raise BadInput(f"--threads must be at least 1, got {options.threads}")
    if not 0 < options.timeout <= MAX_TIMEOUT_S:   # NaN and inf fail this too
        raise BadInput(f"--timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:g} (11 days), "
                       f"got {options.timeout}")
    if options.log_every < 1:
        raise BadInput(f"--log-every must be at least 1, got {options.log_every}")
    if options.data is not None and not is_data_factory(options.data):
        path = Path(options.data)
        if not path.is_file():
            raise BadInput(f"--data '{options.data}' is not a file (nor a pkg.module:factory)")
        try:                      # every rank reads it: refused here, not as a rank's traceback
            path.open("rb").close()
        except OSError as e:
            raise BadInput(f"cannot read --data '{options.data}': {e.strerror or e}") from None
    # Before any rank starts: a report that cannot be written is refused now, not after training.
    # The plan's profile counts as an input: calibrate reads it with the report.
    from ..plan_view import profile_file_of

    profile = profile_file_of(options.plan) if Path(options.plan).is_file() else None
    check_output_paths({"--save": options.save, "--report": options.report, "--trace": options.trace},
                       inputs=tuple(p for p in (options.plan, options.data, options.init_from, profile)
                                    if p is not None and Path(p).is_file()))
    if options.init_from is not None:
        _check_init_from(options.init_from)
    if options.checkpoint_dir is not None:
        folder = Path(options.checkpoint_dir)
        if folder.exists() and not folder.is_dir():
            raise BadInput(f"--checkpoint-dir '{folder}' is a file, not a folder")
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise BadInput(f"--checkpoint-dir '{folder}' is not writable")
    absolute = {k: os.path.abspath(v) for k, v in _paths(options).items()
                if v is not None and not (k == "data" and is_data_factory(v))}
    return dataclasses.replace(options, **absolute)


def async_problem(options: RunOptions, schedule: str, precision: str, gradient_sync: str,
                  recompute: bool) -> str | None:
    """Why a plan of an asynchronous schedule (``pipedream``, ``pipedream-2bw``) cannot run with
    these options, in one line naming what to use instead; None when it can (or the plan is synchronous).

    weight_versions.py defines each stage's updates on its own weights; what needs one step's
    gradient over the whole pipeline (a global norm to clip by or to see an fp16 overflow), a
    sharded optimizer step, or weights shared by two stages is not defined there.
    """
    from ..weight_versions import ASYNC_SCHEDULES

    if schedule not in ASYNC_SCHEDULES:
        return None
    if options.executor == "torch":
        return (f"--executor torch runs torch.distributed.pipelining, whose schedules are synchronous: "
                f"run the {schedule} plan with --executor native (or auto)")
    if options.grad_clip is not None:
        return (f"--grad-clip is not defined for {schedule} (each stage updates on its own, with no global gradient "
                f"norm of a step): leave it out, or solve for a synchronous schedule such as 1f1b")
    if precision == "fp16":
        return (f"fp16 loss scaling is not defined for {schedule} (an overflow must skip one step on every stage "
                f"at once): profile and solve with --precision bf16 (or fp32)")
    if gradient_sync == "fsdp":
        return (f"--gradient-sync fsdp is not supported with {schedule} (its stashed weight versions would be "
                f"whole copies of sharded parameters): solve with --gradient-sync ddp")
    if gradient_sync == "localsgd":
        return (f"--gradient-sync localsgd is not defined with {schedule} (stale updates inside the pipeline and "
                f"replicas drifting between averagings): solve with --gradient-sync ddp, or a synchronous schedule")
    if recompute:
        return (f"recomputation is not supported with {schedule} (the rerun would meet the newest weights, not the "
                f"stashed ones): solve with --recompute never")
    return None


def is_data_factory(data: str) -> bool:
    """``--data`` names a factory (``pkg.module:factory``), not a text file."""
    return ":" in data and not Path(data).exists()


def _check_init_from(path: str) -> None:
    """A file that exists; a ``.safetensors`` one needs the safetensors package (not a dependency)."""
    if not Path(path).is_file():
        raise BadInput(f"--init-from '{path}' is not a file")
    if Path(path).suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        raise BadInput(f"--init-from '{path}' is a .safetensors file: install safetensors (pip install safetensors)")


def _paths(options: RunOptions) -> dict[str, Any]:
    return {k: getattr(options, k) for k in ("plan", "data", "save", "report", "trace", "checkpoint_dir", "init_from")}
