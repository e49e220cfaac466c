"""The one-process reference of the asynchronous pipelines against independent derivations."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_plan.runtime.async_reference import reference_run
from gpipe_plan.schedules import one_f_one_b
from gpipe_plan.weight_versions import problem, stashed_versions, staleness, version_used


def _stages(K: int, width: int = 4, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(K)]


def _batches(steps: int, rows: int, width: int = 4, seed: int = 1) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(rows, width, generator=g),), torch.randn(rows, width, generator=g)) for _ in range(steps)]


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()


def _sgd(lr: float = 0.1):
    return lambda params: torch.optim.SGD(params, lr=lr)


def _pipelined_by_events(stages: list[nn.Module], batches, M: int, lr: float) -> list[float]:
    """pipedream as the pipeline runs it: every stage's 1F1B list over the run, executed in an
    order that respects the messages, each F stashing the weights it used, each B using them."""
    K, micro = len(stages), []
    for inputs, targets in batches:
        micro += list(zip(inputs[0].chunk(M), targets.chunk(M)))
    lists = [one_f_one_b(k, K, len(micro)) for k in range(K)]
    position, stash, acts, grads_in, losses = [0] * K, {}, {}, {}, {}
    done = False
    while not done:
        done, moved = True, False
        for k in range(K):
            if position[k] == len(lists[k]):
                continue
            done = False
            a = lists[k][position[k]]
            i = a.micro_batch
            if a.kind == "F":
                if k > 0 and (k - 1, i) not in acts:
                    continue
                x = micro[i][0] if k == 0 else acts[(k - 1, i)][1].detach().requires_grad_()
                weights = [p.detach().clone().requires_grad_() for p in stages[k].parameters()]
                names = [n for n, _ in stages[k].named_parameters()]
                y = torch.func.functional_call(stages[k], dict(zip(names, weights)), (x,))
                stash[(k, i)] = weights
                acts[(k, i)] = (x, y)
            else:
                if k < K - 1 and (k, i) not in grads_in:
                    continue
                x, y = acts.pop((k, i))
                weights = stash.pop((k, i))
                if k == K - 1:
                    loss = _mse(y, micro[i][1])
                    losses[i] = float(loss)
                    outs = torch.autograd.grad(loss, [*weights, x] if k > 0 else weights)
                else:
                    outs = torch.autograd.grad(y, [*weights, x] if k > 0 else weights, grads_in.pop((k, i)))
                with torch.no_grad():   # SGD on the newest weights
                    for p, g in zip(stages[k].parameters(), outs):
                        p -= lr * g
                if k > 0:
                    grads_in[(k - 1, i)] = outs[-1]
            position[k] += 1
            moved = True
        assert moved or done, "the lists deadlock"
    return [sum(losses[s * M + m] for m in range(M)) / M for s in range(len(batches))]


@pytest.mark.parametrize("K,M", [(2, 2), (3, 4), (4, 3)])
def test_pipedream_reference_equals_the_pipeline_run_event_by_event(K: int, M: int) -> None:
    batches = _batches(steps=3, rows=2 * M)
    ours, theirs = _stages(K), _stages(K)
    losses = reference_run(ours, _mse, batches, "pipedream", M, _sgd())
    expected = _pipelined_by_events(theirs, batches, M, lr=0.1)
    assert losses == pytest.approx(expected, abs=1e-6)
    for a, b in zip(ours, theirs):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.allclose(p, q, atol=1e-6)


def test_pipedream_on_one_stage_is_sgd_per_micro_batch() -> None:
    batches = _batches(steps=3, rows=4)
    (ours,), plain = _stages(1), _stages(1)[0]
    reference_run([ours], _mse, batches, "pipedream", 2, _sgd())
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for (x,), y in batches:
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            optimizer.zero_grad()
            _mse(plain(xm), ym).backward()
            optimizer.step()
    for p, q in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_2bw_is_sgd_on_the_gradient_one_update_old() -> None:
    """W(t+1) = W(t) - lr * grad f_t(W(t-1)), f_t the mean loss of step t's whole batch."""
    K, M, lr = 3, 2, 0.1
    batches = _batches(steps=4, rows=4)
    ours = _stages(K)
    whole = nn.Sequential(*copy.deepcopy(_stages(K)))
    reference_run(ours, _mse, batches, "pipedream-2bw", M, _sgd(lr))
    previous = [p.detach().clone() for p in whole.parameters()]
    for (x,), y in batches:
        current = [p.detach().clone() for p in whole.parameters()]
        with torch.no_grad():
            for p, old in zip(whole.parameters(), previous):
                p.copy_(old)
        whole.zero_grad()
        _mse(whole(x), y).backward()   # the mean over the batch: the mean of its M micro-batch means
        with torch.no_grad():
            for p, now in zip(whole.parameters(), current):
                p.copy_(now - lr * p.grad)
        previous = current
    for p, q in zip([p for s in ours for p in s.parameters()], whole.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_drain_restarts_the_rules_from_the_newest_weights() -> None:
    batches = _batches(steps=4, rows=4)
    drained, two_runs = _stages(2), _stages(2)
    reference_run(drained, _mse, batches, "pipedream", 2, _sgd(), drain_every=2)
    reference_run(two_runs, _mse, batches[:2], "pipedream", 2, _sgd())
    reference_run(two_runs, _mse, batches[2:], "pipedream", 2, _sgd())
    for a, b in zip(drained, two_runs):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_the_rules_in_numbers() -> None:
    # 4 stages: stage 0's micro-batch 5 meets the weights after 2 updates (micro-batches 0, 1 done).
    assert [version_used("pipedream", k, 4, 8, 5) for k in range(4)] == [2, 3, 4, 5]
    assert [staleness("pipedream", k, 4) for k in range(4)] == [3, 2, 1, 0]
    assert [stashed_versions("pipedream", k, 4) for k in range(4)] == [4, 3, 2, 1]
    assert [version_used("pipedream-2bw", 0, 4, 3, i) for i in range(9)] == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert problem("pipedream-2bw", 4, 2) is not None and "at least K - 1 = 3" in problem("pipedream-2bw", 4, 2)
    assert problem("pipedream-2bw", 4, 3) is None and problem("pipedream", 8, 1) is None


def test_localsgd_with_h_1_and_sgd_is_data_parallel_sgd() -> None:
    from gpipe_plan.runtime.async_reference import localsgd_reference
    batches = _batches(steps=3, rows=4)
    replicas = [nn.Sequential(*_stages(2)) for _ in range(2)]
    whole = nn.Sequential(*_stages(2))
    localsgd_reference(replicas, _mse, batches, 1, _sgd())
    optimizer = torch.optim.SGD(whole.parameters(), lr=0.1)
    for (x,), y in batches:
        optimizer.zero_grad()
        _mse(whole(x), y).backward()
        optimizer.step()
    for r in replicas:
        for p, q in zip(r.parameters(), whole.parameters()):
            assert torch.allclose(p, q, atol=1e-6)


def test_localsgd_replicas_drift_apart_between_averages() -> None:
    from gpipe_plan.runtime.async_reference import localsgd_reference
    batches = _batches(steps=3, rows=4)
    replicas = [nn.Sequential(*_stages(2)) for _ in range(2)]
    localsgd_reference(replicas, _mse, batches[:1], 2, _sgd())
    assert not torch.equal(next(replicas[0].parameters()), next(replicas[1].parameters()))
    localsgd_reference(replicas, _mse, batches[1:], 1, _sgd())
    assert torch.equal(next(replicas[0].parameters()), next(replicas[1].parameters()))
