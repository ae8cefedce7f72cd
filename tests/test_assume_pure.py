"""``hops.assume_pure``: traced once per input signature, cached graphs run afterwards, every
HOP allowed in the body, impure functions refused."""

from __future__ import annotations

import pytest
import torch
from hop_db import SAMPLES, forward_backward, fresh
from snapshot import device

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from hops.assume_pure import ImpureFunctionError

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))


def counted(fn):
    """``fn`` and a list that grows by one each time its Python runs."""
    runs = []

    def run(*args, **kwargs):
        runs.append(1)
        return fn(*args, **kwargs)

    run.__qualname__ = getattr(fn, "__qualname__", "fn")
    return run, runs


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_every_hop_runs_from_the_cache_with_eager_values_and_gradients(sample):
    program, runs = counted(sample.program)
    pure = hops.assume_pure(program)
    for seed in (3, 4, 5):  # new values, same signature: traced once
        inputs = sample.inputs(seed=seed)
        got, got_grads = forward_backward(pure, fresh(inputs))
        expected, expected_grads = forward_backward(sample.reference, fresh(inputs))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got_grads, expected_grads, atol=1e-5, rtol=1e-4)
    assert len(runs) == 1
    assert pure.cache_info()[:4] == (2, 1, 1, 1)
    [trace] = pure.cached()
    assert trace.forward is not None and trace.backward is not None
    # The HOP is a node of the cached forward graph, not decomposed.
    assert any(str(node.target).startswith("hops_") for node in trace.forward.graph.nodes)


def test_a_changed_signature_retraces_and_the_same_one_does_not():
    program, runs = counted(lambda x, spec, *, scale: hops.annotate_sharding(x, spec) * scale)
    pure = hops.assume_pure(program)
    x = torch.randn(4, 4)
    calls = [
        ((x, ROWS), {"scale": 2.0}),
        ((torch.randn(4, 4), ROWS), {"scale": 2.0}),  # same signature
        ((torch.randn(8, 4), ROWS), {"scale": 2.0}),  # shape
        ((x.double(), ROWS), {"scale": 2.0}),  # dtype
        ((x.clone().requires_grad_(), ROWS), {"scale": 2.0}),  # requires_grad
        ((x, ROWS), {"scale": 3.0}),  # a number
        ((x, ShardingSpec(MESH, (Replicate(), Shard(1)))), {"scale": 2.0}),  # a spec value
        ((x, ROWS), {"scale": 2.0}),  # the first again
    ]
    for args, kwargs in calls:
        torch.testing.assert_close(pure(*args, **kwargs), args[0] * kwargs["scale"])
    with torch.no_grad():  # grad mode is part of the signature
        pure(x.clone().requires_grad_(), ROWS, scale=2.0)
    assert len(runs) == 7
    assert pure.cache_info() == (2, 7, 7, 7, 8)
    assert [t.signature for t in pure.cached()][:2] == [
        "(float32[8, 4] on cpu, " + repr(ROWS) + ", scale=2.0)",
        "(float64[4, 4] on cpu, " + repr(ROWS) + ", scale=2.0)",
    ]


def test_the_cache_is_bounded_least_recently_used_first_out():
    program, runs = counted(lambda x: x * 2)
    pure = hops.assume_pure(max_cache_size=2)(program)
    a, b, c = torch.randn(1), torch.randn(2), torch.randn(3)
    pure(a), pure(b), pure(a), pure(c)  # b is the least recently used when c comes
    assert [t.signature for t in pure.cached()] == ["(float32[1] on cpu)", "(float32[3] on cpu)"]
    pure(b)
    assert len(runs) == 4 and pure.cache_info().size == 2


def test_a_module_trains_with_an_optimizer_as_eager_does():
    torch.manual_seed(0)

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    eager, model = make(), make()
    pure = hops.assume_pure(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, model)]
    for _ in range(4):
        x = torch.randn(5, 8)
        losses = []
        for m, optimizer in zip((eager, pure), optimizers):
            optimizer.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q, p)
    assert pure.cache_info().traces == 1


def test_fresh_random_numbers_on_every_call():
    pure = hops.assume_pure(lambda x: torch.nn.functional.dropout(x, 0.5))
    x = torch.ones(64)
    assert not torch.equal(pure(x), pure(x))


def test_mutating_an_input_or_a_view_of_one_is_refused():
    def bump(x):
        x.add_(1)
        return x * 2

    def bump_row(x, y):
        x[0].mul_(y)
        return x.sum()

    with pytest.raises(ImpureFunctionError, match=r"assume_pure\(.*bump\): mutates its input args\[0\] \(aten.add_.Tensor\)"):
        hops.assume_pure(bump)(torch.randn(3))
    with pytest.raises(ImpureFunctionError, match=r"mutates its input args\[0\] \(aten.mul_.Tensor\)"):
        hops.assume_pure(bump_row)(torch.randn(3, 3), torch.randn(3))
    state = {"x": torch.randn(3)}
    with pytest.raises(ImpureFunctionError, match=r"mutates its input args\[0\]\['x'\]"):
        hops.assume_pure(lambda s: s["x"].zero_())(state)
    buffered = torch.nn.BatchNorm1d(3)  # updates its running statistics in forward
    with pytest.raises(ImpureFunctionError, match=r"mutates its input args\[0\]\['(running_mean|num_batches_tracked)'\]"):
        hops.assume_pure(buffered)(torch.randn(4, 3))


def test_mutating_an_intermediate_is_allowed():
    def f(x):
        y = x * 2
        y.add_(1)
        return y

    torch.testing.assert_close(hops.assume_pure(f)(torch.ones(3)), torch.full((3,), 3.0))


COUNTER = torch.zeros(())
WEIGHT = torch.nn.Parameter(torch.randn(3))


def test_reading_or_mutating_a_captured_tensor_is_refused():
    scale = torch.randn(3)

    def reads_closure(x):
        return x * scale

    def reads_parameter(x):
        return x * WEIGHT

    def counts(x):
        COUNTER.add_(1)
        return x

    linear = torch.nn.Linear(3, 3)

    def calls_module(x):
        return linear(x)

    with pytest.raises(ImpureFunctionError, match=r"reads scale from its closure or globals; .*pass it as an argument"):
        hops.assume_pure(reads_closure)(torch.randn(3))
    with pytest.raises(ImpureFunctionError, match=r"reads WEIGHT from its closure"):
        hops.assume_pure(reads_parameter)(torch.randn(3))
    with pytest.raises(ImpureFunctionError, match=r"mutates the tensor COUNTER \(add_\)"):
        hops.assume_pure(counts)(torch.randn(3))
    with pytest.raises(ImpureFunctionError, match=r"reads linear.weight from its closure or globals.*hops.assume_pure\(module\)"):
        hops.assume_pure(calls_module)(torch.randn(3))
    assert COUNTER.item() == 0


def test_bad_arguments_and_outputs_are_named():
    with pytest.raises(TypeError, match=r"argument kwargs\['opts'\] is a set, which cannot be part of a signature"):
        hops.assume_pure(lambda x, opts: x)(torch.randn(2), opts=set())
    with pytest.raises(TypeError, match=r"returns a int at output\[1\]; a traced function returns tensors"):
        hops.assume_pure(lambda x: (x, 3))(torch.randn(2))
    with pytest.raises(TypeError, match=r"max_cache_size must be an int >= 1, got 0"):
        hops.assume_pure(max_cache_size=0)(lambda x: x)
    with pytest.raises(TypeError, match=r"expected a function or an nn.Module, got int"):
        hops.assume_pure(3)


# --------------------------------------------------------------------------- on XLA


@pytest.mark.xla
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_on_xla_every_hop_matches_eager_from_one_staged_call(sample):
    import torch_xla

    program, runs = counted(sample.program)
    pure = hops.assume_pure(program)
    for seed in (3, 4):
        inputs = sample.inputs(seed=seed)
        xla_inputs = [t.detach().to(device()).requires_grad_(t.requires_grad) for t in inputs]
        got, got_grads = forward_backward(pure, xla_inputs)
        torch_xla.sync()
        expected, expected_grads = forward_backward(sample.reference, fresh(inputs))
        torch.testing.assert_close([t.cpu() for t in got], expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            [g if g is None else g.cpu() for g in got_grads], expected_grads, atol=1e-5, rtol=1e-4
        )
    assert len(runs) == 1


@pytest.mark.xla
def test_on_xla_a_call_is_one_lazy_node_and_transfers_nothing():
    import torch_xla
    import torch_xla.debug.metrics as metrics

    def layers(x, ws):
        for w in ws:
            x = hops.annotate_sharding(torch.tanh(x @ w), ROWS)
        return x

    pure = hops.assume_pure(layers)
    x = torch.randn(8, 16)
    ws = [torch.randn(16, 16) / 4 for _ in range(10)]
    xla_x, xla_ws = x.to(device()), [w.to(device()) for w in ws]
    torch_xla.sync()
    out = pure(xla_x, xla_ws)
    ir = torch_xla._XLAC._get_xla_tensors_text([out])
    # The ten layers are one staged computation (one node), not forty traced ops.
    assert ir.count("hops_xla::graph") == 1 and "aten::tanh" not in ir and "xla::tanh" not in ir
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert hlo.count('custom_call_target="Sharding"') == 10
    torch_xla.sync()
    torch.testing.assert_close(out.cpu(), layers(x, ws), atol=1e-5, rtol=1e-4)

    def counter(name):
        data = metrics.metric_data(name)
        return data[0] if data else 0

    before = (counter("TransferToDeviceTime"), counter("CompileTime"))
    for _ in range(3):
        out = pure(xla_x, xla_ws)
        torch_xla.sync()
    assert (counter("TransferToDeviceTime"), counter("CompileTime")) == before
    assert pure.cache_info().traces == 1


@pytest.mark.xla
def test_on_xla_each_call_draws_fresh_random_numbers():
    import torch_xla

    pure = hops.assume_pure(lambda x: torch.nn.functional.dropout(x, 0.5))
    x = torch.ones(64, device=device())
    first, second = pure(x), pure(x)
    torch_xla.sync()
    assert not torch.equal(first.cpu(), second.cpu())
