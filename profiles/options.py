"""``gpipe-plan profile``'s options, each declared once (gpipe_plan/options.py): flag, default, help.

The command line is generated from :class:`ProfileOptions`; profiles/command.py checks them
(before the first measurement) and turns them into the profiler's
:class:`~.profiler.ProfileRequest`. No torch here: ``gpipe-plan --help`` reads this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..artifacts import LOSSES, PARAM_DTYPES, PRECISIONS
from ..options import option


@dataclass(frozen=True)
class ProfileOptions:
    """What to measure, how, and where the profile goes."""

    batch_size: int | None = option(
        "--batch-size", type=int,
        help="Largest micro-batch size to measure. Default: 8, or the largest of --micro-batch-sizes.")
    micro_batch_sizes: str | None = option(
        "--micro-batch-sizes", metavar="1,2,4",
        help="Micro-batch sizes to measure. Default: 1, 2, 4, ... doubling up to --batch-size.")
    global_batch_size: int | None = option(
        "--global-batch-size", "-b", type=int,
        help="Samples per training step you mean to train with, recorded in the profile: solve and explore plan "
             "for it unless told otherwise. Default: the largest micro-batch size measured.")
    device: str = option("--device", default="cpu", metavar="cpu|cuda|cuda:N", show_default=True,
                         help="Device to profile on.")
    precision: str = option("--precision", default="fp32", choices=PRECISIONS, show_default=True,
                            help="Compute dtype: bf16/fp16 run every forward under torch.autocast, as "
                                 "`run --precision` will.")
    param_dtype: str = option("--param-dtype", default="fp32", choices=PARAM_DTYPES, show_default=True,
                              help="Dtype of the parameters, gradients and optimizer state (bf16 needs "
                                   "--precision bf16).")
    input_shape: str | None = option("--input-shape", metavar="S",
                                     help="Your model: the shape of one input sample, e.g. 64 or 3,32,32.")
    num_classes: int | None = option("--num-classes", type=int,
                                     help="Your model (and resnet): the number of classes the output scores.")
    input_dtype: str | None = option("--input-dtype", metavar="DTYPE",
                                     help="Your model: input dtype, float32 (default; int64 with --loss "
                                          "lm) or int64 for token ids.")
    vocab_size: int | None = option("--vocab-size", type=int,
                                    help="gpt's vocabulary; for your model with --input-dtype int64, the token id "
                                         "range.")
    loss: str | None = option(
        "--loss", metavar="|".join(LOSSES) + "|pkg.module:fn",
        help="Your model's objective: classify (default; logits (batch, classes) against class ids), lm (logits "
             "(batch, seq, vocab) against the next token of the input ids; needs --vocab-size), or your own "
             "fn(outputs, targets) -> mean loss (with --data).")
    data: str | None = option(
        "--data", metavar="pkg.module:factory",
        help="Your model's data: factory(batch_size) yields (inputs, targets) mini-batches (lm: ids and next ids, "
             "both (batch, seq); classify: class ids (batch,)); the inputs' shapes come from them, and "
             "--input-shape and the like, if given, must agree. `run` trains on them.")
    cut_at: str | None = option(
        "--cut-at", metavar="REGEX",
        help="Your model: module paths that become the layers, e.g. 'model\\.layers\\.\\d+'. Default: each block "
             "of the model's repeated block list, and each other module with weights.")
    layers: int | None = option("--layers", type=int, help="gpt: transformer blocks (default 4).")
    width: int | None = option("--width", type=int,
                               help="gpt: model width (default 128); resnet: base channels (16).")
    heads: int | None = option("--heads", type=int, help="gpt: attention heads (default 4).")
    seq_len: int | None = option("--seq-len", type=int, help="gpt: tokens per sample (default 64).")
    blocks: str | None = option("--blocks", metavar="2,2,2",
                                help="resnet: residual blocks per stage (default 2,2,2).")
    image_size: int | None = option("--image-size", type=int, help="resnet: image side in pixels (default 32).")
    threads: int = option("--threads", default=1, type=int, show_default=True,
                          help="CPU intra-op threads while measuring; runs of a plan use the same per rank.")
    warmup: int = option("--warmup", default=3, type=int, show_default=True,
                         help="Untimed runs before the timed ones.")
    repeats: int = option("--repeats", default=10, type=int, show_default=True,
                          help="Timed runs; the median is kept.")
    seed: int = option("--seed", default=0, type=int, show_default=True,
                       help="Seed of the parameters and synthetic data.")
    measure_link: bool = option(
        "--measure-link", default=False, is_flag=True,
        help="Also measure latency and bandwidth between two processes, and an all-reduce over them (gloo on "
             "CPU; NCCL on CUDA, the all-reduce over every GPU, at most 8).")
    contention_processes: int | None = option(
        "--contention-processes", type=int, metavar="N",
        help="CPU: also time the model with N processes computing at once (as N stages do), so plans predict "
             "what neighbours cost; 0: do not. Default: cores / --threads, at most 8 (0 on one core); more than "
             "the cores run at once is refused.")
    recompute_timing: bool = option(
        "--recompute-timing/--no-recompute-timing", default=True, show_default=True,
        help="Also time every layer under activation checkpointing, so that plans price recomputation as "
             "measured (about a third more profiling time).")
    split_backward_timing: bool = option(
        "--split-backward-timing/--no-split-backward-timing", default=True, show_default=True,
        help="Also time every layer's backward split into the input and the weight gradient, and weigh what "
             "stays alive between them, so that plans price zero-bubble schedules (zb-h1, zb-v) as measured "
             "(about a third more profiling time).")
    fixed_costs: bool = option(
        "--fixed-costs/--no-fixed-costs", default=True, show_default=True,
        help="Also run a short 2-process pipeline of the model's layers to measure what the runtime costs per "
             "action and message, which plans charge (seconds; see docs/profile-format.md).")
    shared_cores: bool = option(
        "--shared-cores/--no-shared-cores", default=True, show_default=True,
        help="With --fixed-costs, on a CPU host that runs at most 4 ranks at once: run that pipeline again on twice "
             "as many processes as the host runs at once, to measure how much slower ranks run where they share "
             "cores, which plans of more stages than cores charge (seconds).")
    layer_by_layer: bool | None = option(
        "--layer-by-layer/--whole-model",
        help="Layer by layer: only the layer being measured is in memory, and layers that are alike (same code, "
             "parameter shapes, input and output shapes: a transformer's blocks) are measured once. Whole model: "
             "every layer measured in the same rounds, next to the model's own step (their sum matches it; layers "
             "timed alone run a few percent faster). Default: whole model up to 1 GiB of parameters, layer by "
             "layer above.")
    measure_every_layer: bool = option("--measure-every-layer", default=False, is_flag=True,
                                       help="Layer by layer: measure every layer, not each kind once.")
    whole_model_check: bool | None = option(
        "--whole-model-check/--no-whole-model-check",
        help="Layer by layer: also time the whole model's training step, to check that the layers add up to it "
             "(the profile's consistency); it needs the whole model in memory. Default: only for models whose "
             "parameters take at most 1 GiB.")
    out: str = option("--out", "-o", default="profile.json", path="file", show_default=True,
                      help="Where to write the profile JSON.")
    quiet: bool = option("--quiet", "-q", default=False, is_flag=True,
                         help="No progress bar or summary; print only the profile's path.")

    def model_options(self) -> dict[str, object]:
        """The options that describe the model (models.model_spec decides which apply to it)."""
        return {name: getattr(self, name) for name in MODEL_OPTIONS}


# The options model_spec takes; the model decides which of them apply to it.
MODEL_OPTIONS = ("layers", "width", "heads", "seq_len", "vocab_size", "blocks", "image_size",
                 "input_shape", "num_classes", "input_dtype", "loss", "cut_at", "data")

__all__ = ["ProfileOptions", "MODEL_OPTIONS"]
