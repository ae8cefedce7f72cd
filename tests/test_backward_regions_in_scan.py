"""Body HOPs whose backward is a region (``local_map``, ``named_scope``), nested in a scan, under
the tracers that differentiate them (AOTAutograd, ``torch.compile`` with ``aot_eager``,
``make_fx`` of a training step).

Generated programs: a scan whose step calls attention (SDPA on CPU, whose backward has no
derivative of its own) inside a region HOP, at depth 1 and 2 (a scan in a scan; a region in a
named scope), the loss inside the traced function. Tracing a scan differentiates its step once:
a region's backward inside it is an op of that derivative, not something to differentiate again
(which would take SDPA's double backward). Loss and gradients against the Python loop.

And double backward through a traced body HOP (``create_graph=True``, then a gradient of the
gradient, under ``make_fx``) equals the Python loop's: the residuals a HOP's forward saved are
functions of its operands, not constants.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import Mesh, Replicate, Shard

MESH = Mesh.of(data=2, model=2)
HEADS = (Shard(0), Shard(1))  # [batch, heads, seq, head_dim]: batch over "data", heads over "model"
ROWS, WHOLE = (Shard(0), Replicate()), (Replicate(), Replicate())
BATCH, SEQ, DIM, NUM_HEADS, LAYERS = 2, 4, 8, 2, 2


def attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


# How the step holds its attention: the HOP nesting around it (innermost last).
def in_local_map(fn):
    return hops.local_map(fn, mesh=MESH, in_placements=(HEADS,) * 3, out_placements=HEADS)


def in_named_scope(fn):
    return hops.named_scope("attention")(fn)


def in_scope_and_region(fn):
    return hops.named_scope("block")(in_local_map(fn))


WRAPPERS = {"local_map": in_local_map, "named_scope": in_named_scope, "named_scope(local_map)": in_scope_and_region}


def layer(h, w, attend, writes=False):
    q = (h @ w).view(BATCH, SEQ, NUM_HEADS, DIM // NUM_HEADS).transpose(1, 2)
    out = attend(q, q.sin(), q.cos())
    h = h + out.transpose(1, 2).reshape(BATCH, SEQ, DIM)
    if writes:  # an in-place write into a tensor the step made: its joint is functionalized
        h = h.clone()
        h[:, 0] = h[:, 0] * 2
    return h


def program(wrapper: str, depth: int, writes: bool = False):
    """``loss(h, ws)``: ``ws`` [outer, inner, DIM, DIM] (depth 2) or [layers, DIM, DIM] scanned."""
    attend = WRAPPERS[wrapper](attention)

    def step(h, w):
        return layer(h, w, attend, writes), None

    def outer_step(h, ws):
        h, _ = hops.scan(step, h, ws)
        return h, h.sum(-1)

    def loss(h, ws):
        if depth == 1:
            h, _ = hops.scan(step, h, ws)
            return h.square().sum()
        h, ys = hops.scan(outer_step, h, ws)
        return h.square().sum() + ys.sum()

    return loss


def reference(h, ws, writes=False):
    ys = []
    for w in ws:
        for inner in w if w.dim() == 3 else [w]:
            h = layer(h, inner, attention, writes)
        ys.append(h.sum(-1))
    return h.square().sum() + (torch.stack(ys).sum() if ws.dim() == 4 else 0)


def inputs(depth: int):
    g = torch.Generator().manual_seed(depth)
    shape = (LAYERS, DIM, DIM) if depth == 1 else (LAYERS, LAYERS, DIM, DIM)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(*shape, generator=g) / DIM


def grads_of(fn, h, ws):
    h, ws = h.clone().requires_grad_(), ws.clone().requires_grad_()
    loss = fn(h, ws)
    return (loss.detach(), *torch.autograd.grad(loss, (h, ws)))


def train_step(loss_fn):
    def step(h, ws):
        loss = loss_fn(h, ws)
        return (loss, *torch.autograd.grad(loss, (h, ws)))

    return step


def aot_autograd(loss_fn, h, ws):
    from functorch.compile import aot_function, nop

    return grads_of(aot_function(loss_fn, nop), h, ws)


def compiled(loss_fn, h, ws):
    torch._dynamo.reset()
    return grads_of(torch.compile(loss_fn, backend="aot_eager", fullgraph=True), h, ws)


def traced_train_step(loss_fn, h, ws):
    leaves = (h.clone().requires_grad_(), ws.clone().requires_grad_())
    gm = make_fx(train_step(loss_fn), tracing_mode="fake")(*leaves)
    return gm(*leaves)


FRONTENDS = {"aot_autograd": aot_autograd, "compile_aot_eager": compiled, "make_fx_train_step": traced_train_step}
# Every wrapper at depth 1 under every frontend (torch.compile, the slowest, on the wrapper
# holding both HOPs); depth 2 (a scan in a scan) with each wrapper under one frontend each,
# so that every frontend meets depth 2.
# And a step that writes in place (its joint traced again through functionalization) under
# each frontend.
CASES = (
    [
        (w, 1, f, False)
        for w, f in itertools.product(WRAPPERS, FRONTENDS)
        if f != "compile_aot_eager" or w == "named_scope(local_map)"
    ]
    + [(w, 2, f, False) for w, f in zip(WRAPPERS, FRONTENDS)]
    + [(w, 1, f, True) for w, f in zip(WRAPPERS, FRONTENDS)]
)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def compiled_cases():
    """The ``compile_aot_eager`` cases of CASES as parts of one program compiled once (Dynamo
    and AOTAutograd cost about as much per compiled program as per op), each part on its own
    inputs, their losses summed inside the compiled function. {case: (loss, grad h, grad ws)}."""
    cases = [case for case in CASES if case[2] == "compile_aot_eager"]
    losses = [program(wrapper, depth, writes) for wrapper, depth, _, writes in cases]
    leaves = [t.clone().requires_grad_() for _, depth, _, _ in cases for t in inputs(depth)]

    def everything(*flat):
        parts = [loss(flat[2 * i], flat[2 * i + 1]) for i, loss in enumerate(losses)]
        return sum(parts), [part.detach() for part in parts]

    torch._dynamo.reset()
    total, parts = torch.compile(everything, backend="aot_eager", fullgraph=True)(*leaves)
    grads = torch.autograd.grad(total, leaves)
    return {case: (parts[i], grads[2 * i], grads[2 * i + 1]) for i, case in enumerate(cases)}


@pytest.mark.parametrize(("wrapper", "depth", "frontend", "writes"), CASES)
def test_a_backward_region_in_a_scan_is_not_differentiated_again(wrapper, depth, frontend, writes):
    h, ws = inputs(depth)
    expected = grads_of(lambda h, ws: reference(h, ws, writes), h, ws)
    if frontend == "compile_aot_eager":
        got = compiled_cases()[(wrapper, depth, frontend, writes)]
    else:
        got = FRONTENDS[frontend](program(wrapper, depth, writes), h, ws)
    for name, a, b in zip(("loss", "grad h", "grad ws"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- double backward


def rows_region(fn):
    return hops.local_map(fn, mesh=MESH, in_placements=(ROWS, WHOLE), out_placements=ROWS)


def cell(x, w):
    return torch.tanh(x @ w) * x.sin()


BODIES = {
    "scan": lambda: (lambda h, ws: hops.scan(lambda h, w: (cell(h, w), None), h, ws)[0]),
    "local_map": lambda: (lambda h, ws: rows_region(cell)(h, ws[0])),
    "named_scope": lambda: (lambda h, ws: hops.named_scope("cell")(cell)(h, ws[0])),
    "scan(local_map)": lambda: (lambda h, ws: hops.scan(lambda h, w: (rows_region(cell)(h, w), None), h, ws)[0]),
}
PLAIN = {
    "scan": lambda h, ws: _loop(h, ws),
    "local_map": lambda h, ws: cell(h, ws[0]),
    "named_scope": lambda h, ws: cell(h, ws[0]),
    "scan(local_map)": lambda h, ws: _loop(h, ws),
}


def _loop(h, ws):
    for w in ws:
        h = cell(h, w)
    return h


def second_order(fn):
    def run(h, ws):
        (g,) = torch.autograd.grad(fn(h, ws).square().sum(), ws, create_graph=True)
        return torch.autograd.grad(g.sin().sum(), (h, ws))

    return run


@pytest.mark.parametrize("body", BODIES)
def test_double_backward_through_a_traced_body_hop(body):
    g = torch.Generator().manual_seed(0)
    h, ws = torch.randn(4, 3, generator=g).requires_grad_(), (torch.randn(2, 3, 3, generator=g) / 2).requires_grad_()
    expected = second_order(PLAIN[body])(h, ws)
    got = make_fx(second_order(BODIES[body]()), tracing_mode="fake")(h, ws)(h, ws)
    for name, a, b in zip(("d/dh", "d/dws"), got, expected):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("wrap", ["local_map", "named_scope"])
@pytest.mark.parametrize("frontend", ["fake", "compile_aot_eager"])
def test_a_users_create_graph_gradient_over_a_region_holding_sdpa_traces_like_eager(wrap, frontend):
    """The user asks for a gradient with ``create_graph=True`` over a region holding SDPA and
    reads it (a gradient penalty): the backward region is differentiable in principle, but its
    SDPA backward has no derivative. As eager torch: the program traces and runs, and only
    differentiating that gradient again raises autograd's error."""
    attend = WRAPPERS[wrap](attention)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(DIM, DIM, generator=g) / DIM

    def penalty_of(attend):
        def penalty(h, w):
            (grad,) = torch.autograd.grad(layer(h, w, attend).square().sum(), w, create_graph=True)
            return grad.square().sum()

        return penalty

    penalty = penalty_of(attend)
    expected = penalty_of(attention)(h, w.clone().requires_grad_())
    if frontend == "compile_aot_eager":
        torch._dynamo.reset()
        got = torch.compile(penalty, backend="aot_eager")(h, w.clone().requires_grad_())
    else:
        got = make_fx(penalty, tracing_mode=frontend)(h, w.clone().requires_grad_())(h, w.clone().requires_grad_())
        with pytest.raises(RuntimeError, match=r"derivative for .*flash_attention_for_cpu_backward is not implemented"):
            make_fx(lambda h, w: torch.autograd.grad(penalty(h, w), w), tracing_mode=frontend)(h, w.clone().requires_grad_())
    torch.testing.assert_close(got, expected)
