"""``hops.assume_pure``: traced once per input signature, cached graphs run afterwards, every
HOP allowed in the body, impure functions refused."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec, _targets
from hops._eager_graph import EagerGraph
from hops._graph_function import GraphFunction
from hops.assume_pure import ImpureFunctionError
from tests.helpers.hop_db import SAMPLES, forward_backward, fresh
from tests.helpers.snapshot import device, normalize

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
COLUMNS = ShardingSpec(MESH, (Replicate(), Shard(1)))


@pytest.fixture(params=["eager", "staged"])
def runner(request, monkeypatch):
    """How cached graphs run on CPU: "eager" (the default off XLA: the recorded graph's code,
    differentiated by the autograd engine as it runs) or "staged" (the path of a device whose
    target registers a graph compiler, as XLA's does: forward and backward graphs, here
    compiled by running them as they are)."""
    if request.param == "staged":
        stage_on_cpu(monkeypatch)
    return request.param


def stage_on_cpu(monkeypatch):
    from functorch.compile import make_boxed_func

    def compiler(gm, example_inputs):  # as XLA's: a boxed function (a list of arguments)
        return make_boxed_func(gm)

    monkeypatch.setitem(_targets._GRAPH_COMPILERS, "cpu", (compiler, None))


def counted(fn):
    """``fn`` and a list that grows by one each time its Python runs."""
    runs = []

    def run(*args, **kwargs):
        runs.append(1)
        return fn(*args, **kwargs)

    run.__qualname__ = getattr(fn, "__qualname__", "fn")
    return run, runs


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_every_hop_runs_from_the_cache_with_eager_values_and_gradients(sample, runner):
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
    if runner == "staged":
        assert trace.forward is not None and trace.backward is not None
    else:  # the autograd engine differentiates the forward graph as it runs
        assert isinstance(trace.run, EagerGraph) and trace.backward is None
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


def test_a_module_trains_with_an_optimizer_as_eager_does(runner):
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


def test_fresh_random_numbers_on_every_call(runner):
    pure = hops.assume_pure(lambda x: torch.nn.functional.dropout(x, 0.5))
    x = torch.ones(64)
    assert not torch.equal(pure(x), pure(x))


def test_mutating_an_input_or_a_view_of_one_is_refused(runner):
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


def test_reading_or_mutating_a_captured_tensor_is_refused(runner):
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


def stacked_layers(x, weights, specs):
    """Layers with reshapes and transposes (views the backward recomputes), each annotated."""
    for w, spec in zip(weights, specs):
        h = (x.reshape(-1, x.shape[-1]) @ w.t()).view_as(x)
        x = hops.annotate_sharding(x + torch.tanh(h) * torch.sigmoid(h), spec)
    return x


def layer_inputs(layers, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=dtype, requires_grad=True)
    weights = [(torch.randn(4, 4, dtype=dtype) / 2).requires_grad_() for _ in range(layers)]
    return x, weights


def test_gradients_match_eager_and_pass_gradcheck(runner):
    x, weights = layer_inputs(3, torch.float64)
    specs = (ROWS,) * 3
    pure = hops.assume_pure(stacked_layers)
    got, got_grads = forward_backward(lambda x, *w: pure(x, w, specs), [x, *weights])
    expected, expected_grads = forward_backward(lambda x, *w: stacked_layers(x, w, specs), fresh([x, *weights]))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grads, expected_grads)
    assert torch.autograd.gradcheck(lambda x, *w: pure(x, w, specs), [x.detach().requires_grad_(), *weights])
    assert pure.cache_info().traces == 1


def test_residuals_of_repeated_layers_are_stacked_into_a_fixed_number_of_tensors(monkeypatch):
    stage_on_cpu(monkeypatch)  # residuals are the staged path's
    def residuals(layers, specs):
        pure = hops.assume_pure(stacked_layers)
        x, weights = layer_inputs(layers)
        pure(x, weights, specs).sum().backward()
        [trace] = pure.cached()
        saved_in_forward = len(trace.forward.graph.output_node().args[0]) - 1
        return trace.run.num_residuals, saved_in_forward

    # The same activations of each layer are one stacked tensor: more layers, no more tensors.
    assert residuals(4, (ROWS,) * 4) == residuals(12, (ROWS,) * 12)
    count, _ = residuals(12, (ROWS,) * 12)
    assert count <= 6
    # Layers annotated differently keep their residuals apart (they may be sharded apart).
    alternating, _ = residuals(12, (ROWS, COLUMNS) * 6)
    assert alternating > count


def test_an_input_modified_in_place_before_the_backward_is_caught_as_in_eager(runner):
    pure = hops.assume_pure(lambda x, w: torch.tanh(x @ w))
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    out = pure(x, w)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_outputs_that_are_views_repeats_and_non_differentiable_values(runner):
    def views(x, w):
        y = torch.tanh(x @ w)
        return {"rows": y.t(), "flat": y.reshape(-1), "again": y.reshape(-1), "count": (y > 0).sum()}

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    pure = hops.assume_pure(views)
    got, expected = pure(x, w), views(x, w)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])
    assert not got["count"].requires_grad and got["rows"].requires_grad
    # The cached graphs, not AOTAutograd's runtime.
    assert isinstance(pure.cached()[0].run, GraphFunction if runner == "staged" else EagerGraph)

    def loss(outputs):
        return outputs["rows"].sum() + 2 * outputs["flat"].sum() + 3 * (outputs["again"] ** 2).sum()

    torch.testing.assert_close(torch.autograd.grad(loss(got), [x, w]), torch.autograd.grad(loss(expected), [x, w]))


def test_an_output_that_is_a_view_of_an_input_stays_one(runner):
    pure = hops.assume_pure(lambda x, w: (x.view(-1), torch.tanh(x @ w)))
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    flat, y = pure(x, w)
    assert flat._base is x
    (flat.sum() + y.sum()).backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 4) + (1 - torch.tanh(x @ w) ** 2).detach() @ w.detach().t())


def test_without_grad_mode_no_backward_graph_is_made(runner):
    pure = hops.assume_pure(lambda x, w: torch.tanh(x @ w))
    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    with torch.no_grad():
        out = pure(x, w)
    torch.testing.assert_close(out, torch.tanh(x @ w))
    assert not out.requires_grad
    [trace] = pure.cached()
    assert trace.backward is None


# --------------------------------------------------------------------------- off XLA: the recorded code


def test_grad_mode_changes_inside_the_function_are_kept(runner):
    def f(x, w):
        with torch.no_grad():
            scale = (x @ w).abs().amax()
        y = torch.tanh(x @ w) / scale
        return y + (y * 3).detach(), scale

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    pure = hops.assume_pure(f)
    for _ in range(2):  # traced, then from the cache
        got, got_grads = forward_backward(pure, [x, w])
        expected, expected_grads = forward_backward(f, fresh([x, w]))
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(got_grads, expected_grads)
        x.grad = w.grad = None
    assert not got[1].requires_grad


def test_a_write_hidden_inside_a_composite_op_is_refused():
    # instance_norm's schema does not say it updates the running statistics; its ATen ops do.
    def normalize(x, mean, var):
        return torch.nn.functional.instance_norm(x, mean, var, use_input_stats=True)

    mean = torch.zeros(3)
    with pytest.raises(ImpureFunctionError, match=r"mutates its input args\[1\] \(aten.copy_.default\)"):
        hops.assume_pure(normalize)(torch.randn(2, 3, 5), mean, torch.ones(3))
    assert torch.equal(mean, torch.zeros(3))


def python_frames(fn, *args):
    """The Python functions entered while ``fn(*args)`` runs (``sys.setprofile``)."""
    entered = []

    def profile(frame, event, arg):
        if event == "call":
            entered.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return entered


def test_a_cached_call_enters_a_fixed_few_python_functions():
    # Off XLA a cached call costs what the ops cost: a few Python functions (keying the call,
    # the recorded code), however many ops; no OpOverload call, no autograd.Function.
    def layers(x, weights):
        for w in weights:
            x = x + torch.tanh(x @ w).transpose(0, 1).reshape(4, 4).softmax(-1) * 0.5
        return x

    frames = {}
    for depth in (2, 8):
        pure = hops.assume_pure(layers)
        x = torch.randn(4, 4, requires_grad=True)
        weights = [torch.randn(4, 4, requires_grad=True) for _ in range(depth)]
        pure(x, weights)
        frames[depth] = python_frames(pure, x, weights)
        torch.testing.assert_close(pure(x, weights), layers(x, weights), rtol=0, atol=0)
        assert not any("torch/_ops.py" in f or "autograd/function.py" in f for f in frames[depth]), frames[depth]
    assert len(frames[2]) == len(frames[8]) <= 8, frames


OPS = {
    "add_scalar": lambda x, y: x + 2,
    "add_alpha": lambda x, y: x.add(y, alpha=2),
    "rsub": lambda x, y: 1 - x,
    "mul_float_scalar": lambda x, y: x * 2.5,
    "pow_scalar_base": lambda x, y: 2 ** x,
    "pow": lambda x, y: x.pow(2),
    "div_floor": lambda x, y: x.div(3, rounding_mode="floor"),
    "true_div": lambda x, y: x / 3,
    "sum_dtype": lambda x, y: torch.sum(x, 1, dtype=torch.float64),
    "mean_keepdim": lambda x, y: x.float().mean(-1, keepdim=True),
    "amax": lambda x, y: x.amax(0),
    "max_dim": lambda x, y: x.max(dim=1).values,
    "maximum": lambda x, y: torch.maximum(x, y),
    "where_scalar": lambda x, y: torch.where(x > 0, x, 0.0),
    "clamp_min": lambda x, y: x.clamp(min=-1),
    "cat": lambda x, y: torch.cat([x, y], 1),
    "stack": lambda x, y: torch.stack([x, y]),
    "chunk": lambda x, y: x.chunk(2, 1)[1],
    "split_sizes": lambda x, y: x.split([1, 3], 1)[0],
    "unbind": lambda x, y: x.unbind(0)[2],
    "slice": lambda x, y: x[:, 1:3],
    "index_select": lambda x, y: x.index_select(1, torch.tensor([3, 0])),
    "transpose_reshape": lambda x, y: x.transpose(0, 1).reshape(-1),
    "expand": lambda x, y: x.expand(2, -1, -1),
    "view_flat": lambda x, y: x.view(-1),
    "flatten": lambda x, y: x[None].flatten(1),
    "to_double": lambda x, y: x.to(torch.float64),
    "type_as": lambda x, y: x.type_as(y),
    "new_zeros": lambda x, y: x.new_zeros(3) + x.sum(),
    "full_like": lambda x, y: torch.full_like(x, 2),
    "arange": lambda x, y: x + torch.arange(4),
    "ones_dtype": lambda x, y: x * torch.ones(4, dtype=torch.int64),
    "masked_fill": lambda x, y: x.masked_fill(x > 0, 1),
    "softmax": lambda x, y: x.float().softmax(-1),
    "matmul": lambda x, y: x @ y.t(),
    "linear": lambda x, y: torch.nn.functional.linear(x, y),
    "neg_abs": lambda x, y: -x.abs(),
    "eq": lambda x, y: x == y,
}


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=6, unique=True),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
    requires_grad=st.booleans(),
)
def test_generated_programs_run_the_ops_they_were_traced_with(names, dtype, requires_grad):
    # Off XLA each recorded op is called through torch's Python binding of its name, which
    # picks an overload from the arguments: it must pick the traced one (same values, dtype,
    # shape, strides, gradients as eager, bit for bit).
    def program(x, y):
        return tuple(OPS[name](x, y) for name in names)

    grad = requires_grad and dtype.is_floating_point
    make = torch.randn if dtype.is_floating_point else lambda *shape, dtype: torch.randint(-3, 4, shape, dtype=dtype)
    torch.manual_seed(0)
    x, y = make(3, 4, dtype=dtype).requires_grad_(grad), make(3, 4, dtype=dtype).requires_grad_(grad)
    pure = hops.assume_pure(program)
    for _ in range(2):  # traced, then from the cache
        got, expected = pure(x, y), program(x, y)
        for name, a, b in zip(names, got, expected):
            assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad), name
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        if grad:
            weighted = [(i + 1) * o.sum() for i, (o, e) in enumerate(zip(got, expected)) if o.requires_grad]
            if weighted:
                reference = [(i + 1) * e.sum() for i, (o, e) in enumerate(zip(got, expected)) if o.requires_grad]
                got_grads = torch.autograd.grad(sum(weighted), [x, y], allow_unused=True)
                expected_grads = torch.autograd.grad(sum(reference), [x, y], allow_unused=True)
                torch.testing.assert_close(got_grads, expected_grads, rtol=0, atol=0)
    assert pure.cache_info().traces == 1


def test_the_recorded_code_calls_torch_bindings():
    def f(x, w):
        h = torch.nn.functional.linear(x, w).view(2, 2, 4).transpose(1, 2)
        return h.softmax(-1).sum(dtype=torch.float64) + x[:, 1:].mean()

    pure = hops.assume_pure(f)
    pure(torch.randn(4, 4), torch.randn(4, 4))
    [trace] = pure.cached()
    assert normalize(trace.run.run_graph.code) == normalize("""\
def forward(self, arg0_1, arg1_1):
    linear = torch._C._nn.linear(arg0_1, arg1_1);  arg1_1 = None
    view = torch_Tensor_view(linear, [2, 2, 4]);  linear = None
    transpose = torch.transpose(view, 1, 2);  view = None
    softmax = torch.softmax(transpose, -1);  transpose = None
    sum_1 = torch.sum(softmax, dtype = torch.float64);  softmax = None
    slice_1 = torch.ops.aten.slice.Tensor(arg0_1, 1, 1, 9223372036854775807);  arg0_1 = None
    mean = torch.mean(slice_1);  slice_1 = None
    add = torch.add(sum_1, mean);  sum_1 = mean = None
    return (add,)
""")


def test_ops_that_return_their_input_are_not_run():
    # ``to`` its own dtype returns the tensor itself and a full slice an alias nothing tells
    # apart: eager pays a call for each, the recorded code need not (HF's RMSNorm has two per
    # layer). An alias that is an output stays one: it is a new tensor viewing the input.
    def f(x, m):
        h = x.to(torch.float32) * m[:, :4]
        return h.to(torch.float32), x[:, :4]

    pure = hops.assume_pure(f)
    x, m = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    out, view = pure(x, m)
    [trace] = pure.cached()
    assert normalize(trace.run.run_graph.code) == normalize("""\
def forward(self, arg0_1, arg1_1):
    mul = torch.mul(arg0_1, arg1_1);  arg1_1 = None
    alias_1 = torch.ops.aten.alias.default(arg0_1);  arg0_1 = None
    return (mul, alias_1)
""")
    assert view is not x and view._base is x
    (out.sum() + view.sum()).backward()
    torch.testing.assert_close(out, x * m)
    torch.testing.assert_close(x.grad, m + 1)


class Block(torch.nn.Module):
    """A module whose state a user changes between calls (see below)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x):
        out = torch.tanh(self.inner(x)) + self.shift + sum(b.sum() for b in self.inner.buffers())
        return out * (2.0 if self.training else 0.5) - (1.0 if self.inner.training else 0.0)


def _freeze(m):
    m.inner.weight.requires_grad_(False)


def _new_submodule(m):
    m.inner = torch.nn.Linear(4, 4)


def _transposed_data(m):
    m.inner.weight.data = torch.randn(4, 4).t()


def _drop_bias(m):
    m.inner.bias = None


def _new_buffer(m):
    m.inner.register_buffer("extra", torch.ones(2))


def _new_shape(m):
    m.inner = torch.nn.Linear(4, 4, bias=False).double().float()
    m.shift = torch.randn(1)


def _eval(m):
    m.eval()


def _train_inner(m):
    m.inner.train()


def _in_place_update(m):
    with torch.no_grad():
        m.inner.weight.mul_(0.5)


CHANGES = {
    "freeze": _freeze,
    "new_submodule": _new_submodule,  # new tensors, the signature of the old ones
    "transposed_data": _transposed_data,  # same shape, other strides
    "drop_bias": _drop_bias,
    "new_buffer": _new_buffer,
    "new_shape": _new_shape,
    "in_place_update": _in_place_update,
    "eval": _eval,  # what forward does changes with the modules' training flags
    "train_inner": _train_inner,
}


def state_signature(module):
    """What a traced graph of ``module`` depends on: each state tensor's name and layout, and
    each module's training flag."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    modes = tuple(m.training for m in module.modules())
    return modes, tuple((name, t.shape, t.stride(), t.dtype, t.requires_grad) for name, t in named)


@given(order=st.permutations(list(CHANGES)))
@settings(max_examples=8, deadline=None)
def test_a_module_changed_between_calls_runs_as_eager_does(order):
    # A wrapped module's state is read on every call: a change to it (a tensor replaced, its
    # layout, a slot emptied or added, requires_grad, train / eval) is a new signature, or the
    # same one run on the new tensors; never the traced tensors, never a stale graph.
    torch.manual_seed(0)
    model = Block()
    pure = hops.assume_pure(model)
    x = torch.randn(3, 4, requires_grad=True)
    seen = set()
    for change in (None, *order):
        traces = pure.cache_info().traces
        if change is not None:
            CHANGES[change](model)
        for fn in (model, pure, pure):  # eager, then the call that may trace, then a cached one
            x.grad = None
            model.zero_grad(set_to_none=True)
            out = fn(x)
            out.square().sum().backward()
            got = (out, x.grad, [p.grad for p in model.parameters()])
            if fn is model:
                expected = got
            else:
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
        new = state_signature(model) not in seen
        seen.add(state_signature(model))
        assert pure.cache_info().traces == traces + new, change


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
@pytest.mark.parametrize("before", ["sync", "a_random_result_read_without_sync"])
def test_on_xla_each_call_draws_fresh_random_numbers(before):
    import torch_xla

    torch_xla.sync()
    if before != "sync":
        # Reading a result with .cpu() runs its graph without a sync: the RNG seed a later
        # staging reads is then not the device's root seed node.
        hops.assume_pure(lambda x: torch.nn.functional.dropout(x, 0.5))(torch.ones(32, device=device())).cpu()
    pure = hops.assume_pure(lambda x: torch.nn.functional.dropout(x, 0.5))
    x = torch.ones(64, device=device())
    first, second = pure(x), pure(x)
    torch_xla.sync()
    assert not torch.equal(first.cpu(), second.cpu())


@pytest.mark.xla
def test_on_xla_forward_and_backward_are_one_lazy_node_each():
    import torch_xla

    pure = hops.assume_pure(stacked_layers)
    x, weights = layer_inputs(6)
    specs = (ROWS,) * 6
    xla_x = x.detach().to(device()).requires_grad_()
    xla_weights = [w.detach().to(device()).requires_grad_() for w in weights]
    for _ in range(2):  # traced, then from the cache
        out = pure(xla_x, xla_weights, specs)
        grads = torch.autograd.grad(out.sum(), [xla_x, *xla_weights])
        ir = torch_xla._XLAC._get_xla_tensors_text(list(grads))
        # One node for the forward (the gradients read its residuals), one for the backward.
        assert ir.count("hops_xla::graph") == 2 and "tanh" not in ir and "sigmoid" not in ir
        torch_xla.sync()
    expected = torch.autograd.grad(stacked_layers(x, weights, specs).sum(), [x, *weights])
    torch.testing.assert_close([g.cpu() for g in grads], list(expected), atol=1e-5, rtol=1e-4)
    assert pure.cache_info().traces == 1


@pytest.mark.parametrize("first", ["contiguous", "transposed"])
def test_an_argument_laid_out_otherwise_is_traced_again(runner, first):
    """A graph keeps its trace's layout decisions (``reshape`` traced on a contiguous tensor is
    a ``view``): the same shape in another layout is another signature."""

    def fn(x, w):
        return x.reshape(-1, 4) @ w

    pure = hops.assume_pure(fn)
    base = torch.randn(4, 8)
    layouts = {"contiguous": base.contiguous(), "transposed": base.t().contiguous().t()}
    w = torch.randn(4, 3, requires_grad=True)
    for name in (first, *(n for n in layouts if n != first)):
        x = layouts[name].detach().requires_grad_()
        out = pure(x, w)
        expected_x, expected_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        expected = fn(expected_x, expected_w)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.sum(), (x, w))
        torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (expected_x, expected_w)))
