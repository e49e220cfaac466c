"""The torch executor on the torch that is installed, not only the one we develop with.

The GPU machine's image ships torch 2.11, whose ``PipelineStage`` takes no gradient metadata
(``output_grads``, ``input_grads`` arrived in 2.13); passing them there is a TypeError on the
first CUDA run. The executor also runs the planner's action lists through torch's private
``_PipelineScheduleRuntime`` and its ``_prepare_schedule_with_comms``, which older releases
lack. These tests give the executor classes with the signatures of older releases (copied
from their sources) and check what it passes and what it refuses.
"""

from __future__ import annotations

import pytest
import torch

from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.models import build_model, model_spec
from helpers.handplan import hand_plan
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.stage import build_chunk
from gpipe_plan.runtime.torch_executor import check_features, pipeline_stage_arguments, pipelining_features

GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)


class Stage211:
    """``torch.distributed.pipelining.PipelineStage.__init__`` as torch 2.11 has it."""

    def __init__(self, submodule, stage_index, num_stages, device, input_args=None, output_args=None,  # noqa: ANN001
                 group=None, dw_builder=None) -> None: ...


class Multi211:
    """``PipelineScheduleMulti`` of torch 2.11 (the runtime's base, which names the arguments)."""

    def __init__(self, stages, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,  # noqa: ANN001
                 output_merge_spec=None, use_full_backward=None, scale_grads=True) -> None: ...

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs) -> None: ...  # noqa: ANN001, ANN002, ANN003


class Runtime211(Multi211):
    """``_PipelineScheduleRuntime`` of torch 2.11: it passes ``*args, **kwargs`` on to its base."""

    def __init__(self, *args, **kwargs) -> None: ...  # noqa: ANN002, ANN003

    def _prepare_schedule_with_comms(self, actions, format="compute_only") -> None: ...  # noqa: ANN001, A002


class Stage24:
    """``PipelineStage.__init__`` of torch 2.4: static shapes, no gradient metadata."""

    def __init__(self, submodule, stage_index, num_stages, device, input_args, output_args=None,  # noqa: ANN001
                 group=None, dw_builder=None) -> None: ...


@pytest.fixture
def two_chunks(tmp_path):  # noqa: ANN001, ANN201
    """Both chunks of a 2-stage gpt plan: the first receives activations from no one, the last
    receives no gradients."""
    write_json_atomic(tmp_path / "plan.json", hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2))
    plan = load_plan(tmp_path / "plan.json")
    return [build_chunk(build_model(GPT), plan, c) for c in range(2)]


def test_the_installed_torch_is_read_as_it_is(two_chunks) -> None:  # noqa: ANN001
    """2.13 takes the gradients' metadata and gets it for the cuts that have one; 2.11 (the GPU
    image's) takes none and gets none; both have what every run needs."""
    features = pipelining_features()
    assert features.action_runtime and features.static_shapes and features.scale_grads and features.return_outputs
    check_features(features)
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 13):
        assert features.grad_metas
        first, last = (pipeline_stage_arguments(c, torch.device("cpu"), features) for c in two_chunks)
        assert first["output_grads"] is not None and first["input_grads"] is None
        assert last["output_grads"] is None and last["input_grads"] is not None
    elif version <= (2, 11):
        assert not features.grad_metas
        assert all(set(pipeline_stage_arguments(c, torch.device("cpu"), features)) == {"input_args", "output_args"}
                   for c in two_chunks)


def test_torch_2_11_gets_no_gradient_metadata(two_chunks) -> None:  # noqa: ANN001
    """Its runtime's own ``__init__`` names no argument: scale_grads is read off its base."""
    features = pipelining_features(Stage211, Runtime211)
    assert features.action_runtime and features.static_shapes and not features.grad_metas
    assert features.scale_grads and features.return_outputs
    check_features(features)
    for chunk in two_chunks:
        arguments = pipeline_stage_arguments(chunk, torch.device("cpu"), features)
        assert set(arguments) == {"input_args", "output_args"}
        Stage211(chunk.module, chunk.index, 2, torch.device("cpu"), **arguments)  # what the executor will call
    received = pipeline_stage_arguments(two_chunks[1], torch.device("cpu"), features)["input_args"]
    assert all(x.requires_grad for x in received)   # the last chunk's inputs are leaves needing gradients


def test_a_torch_without_the_action_list_runtime_is_refused_in_one_line() -> None:
    """torch 2.4 has no ``_PipelineScheduleRuntime``; one without ``_prepare_schedule_with_comms``
    cannot be given a list either."""
    class RuntimeWithoutLists(Multi211):
        pass

    for runtime in (None, RuntimeWithoutLists):
        features = pipelining_features(Stage24, runtime)
        assert not features.action_runtime and features.static_shapes
        with pytest.raises(BadInput) as caught:
            check_features(features)
        message = str(caught.value)
        assert "\n" not in message and "lacks _PipelineScheduleRuntime._prepare_schedule_with_comms" in message
        assert "--executor native" in message
