"""Property tests: random bodies through every body HOP, against their references.

A body is a random chain of ops: elementwise math, a matmul with a closed-over weight,
factories (``torch.ones``/``arange``), dropout, a write into an input. Each HOP runs it
eager and traced (AOTAutograd); the result and the gradients (of the inputs and of the
closed-over weight) must equal the plain-torch reference with the same seed, and a write
into an input must be refused before any caller tensor changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hops
from hops import Mesh, Replicate, Shard
from tests.helpers.samples_together import combined
from tests.helpers.snapshot import aot_trace, compile_trace

WIDTH = 4
LINE = Mesh((2,), ("a",))

# Row-local ops (each row's result depends on that row only), so a region sharding rows
# computes what the op computes on the whole tensor.
OPS = {
    "sin": lambda t, w: t.sin(),
    "scale": lambda t, w: t * 1.5,
    "closure_add": lambda t, w: t + w[0],
    "closure_matmul": lambda t, w: torch.tanh(t @ w),
    "factory_ones": lambda t, w: t * torch.ones(WIDTH) + torch.arange(WIDTH, dtype=t.dtype),
    "factory_like": lambda t, w: t + torch.full_like(t, 0.25),
    "cumsum": lambda t, w: t.cumsum(-1) / WIDTH,
    "square": lambda t, w: t * t,
}

# Views, slices and in-place writes into tensors the body made itself (legal in a body):
# a traced body records them as views and ``copy_``/``index_put_`` into them, which every
# consumer of the traced graph must keep (row-local too).


def _write_into_clone(t, w):
    u = t.clone()
    u[..., 0] = t[..., -1] * 2
    return u


def _slice_assign_from_closure(t, w):
    u = t.clone()
    u[..., 1:3] = torch.tanh(t[..., :2] @ w[:2, :2])
    return u


def _in_place_on_intermediate(t, w):
    u = t * 1.0
    u.add_(w[0])
    return u.mul_(0.5)


def _index_put(t, w):
    u = t.clone()
    u[..., torch.tensor([0, 2])] = u[..., torch.tensor([1, 3])] * w[1, 0]
    return u


def _write_through_view(t, w):
    u = t.clone()
    u.view(*u.shape[:-1], 2, 2).select(-1, 0).mul_(3)
    return u


VIEW_AND_WRITE_OPS = {
    "write_into_clone": _write_into_clone,
    "slice_assign_from_closure": _slice_assign_from_closure,
    "in_place_on_intermediate": _in_place_on_intermediate,
    "index_put": _index_put,
    "write_through_view": _write_through_view,
    "view_roundtrip": lambda t, w: t.view(*t.shape[:-1], 2, 2).flip(-1).reshape(t.shape),
    "rotate_slices": lambda t, w: torch.cat([t[..., 2:], t[..., :2]], -1),
    "transpose_matmul": lambda t, w: t @ w.t(),
}
OPS.update(VIEW_AND_WRITE_OPS)

chains = st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=4)
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# An example tracing each HOP's program with AOTAutograd costs about a second and a half; a new
# draw each run.
TRACED_SETTINGS = settings(SETTINGS, max_examples=6)


def make_body(chain, w):
    def body(t):
        for name in chain:
            t = OPS[name](t, w)
        return t

    return body


def inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, WIDTH, generator=generator, dtype=torch.double)
    w = torch.randn(WIDTH, WIDTH, generator=generator, dtype=torch.double) / 2
    return x, w


def gradients(fn, x, w, w_requires_grad=True):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(w_requires_grad)
    out = fn(x, w)
    leaves = torch.utils._pytree.tree_leaves(out)
    wanted = (x, w) if w_requires_grad else (x,)
    grads = torch.autograd.grad(sum(o.sum() for o in leaves), wanted, allow_unused=True)
    return out, tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, wanted))


def together(programs):
    """One program running each of ``programs`` (each ``program(x, w)``) on its own ``x`` and
    ``w``: ``together(programs)(x0, w0, x1, w1, ...)`` is the tuple of their outputs. A compiler
    compiles it once (Dynamo and AOTAutograd cost about as much per compiled program as per op)."""
    return combined(programs, [2] * len(programs))


def leaves_for(programs, x, w, w_requires_grad=True):
    """Fresh leaves ``(x0, w0, x1, w1, ...)``, one pair per program."""
    return [t for _ in programs for t in (x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(w_requires_grad))]


def gradient_of(t):
    return torch.zeros_like(t) if t.grad is None else t.grad


def programs(chain):
    """(name, program(x, w) using the HOP, reference(x, w) in plain torch)."""

    def scan_program(x, w):
        body = make_body(chain, w)
        return hops.scan(lambda c, row: (body(c + row), c.sum()), torch.zeros(WIDTH, dtype=x.dtype), x)

    def scan_reference(x, w):
        body, c, ys = make_body(chain, w), torch.zeros(WIDTH, dtype=x.dtype), []
        for row in x:
            c, y = body(c + row), c.sum()
            ys.append(y)
        return c, torch.stack(ys)

    def region_program(x, w):
        return hops.local_map(make_body(chain, w), mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))(x)

    def scope_program(x, w):
        return hops.named_scope("random")(make_body(chain, w))(x)

    def plain(x, w):
        return make_body(chain, w)(x)

    return [("scan", scan_program, scan_reference), ("local_map", region_program, plain), ("named_scope", scope_program, plain)]


@TRACED_SETTINGS
@given(chain=chains, seed=st.integers(0, 2**16))
def test_random_bodies_match_their_reference_eager_and_traced(chain, seed):
    x, w = inputs(seed)
    for name, program, reference in programs(chain):
        expected, expected_grads = gradients(reference, x, w)
        got, got_grads = gradients(program, x, w)
        torch.testing.assert_close(got, expected, msg=f"{name} eager {chain}")
        torch.testing.assert_close(got_grads, expected_grads, msg=f"{name} eager gradients {chain}")
        traced_x, traced_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        _, _, traced = aot_trace(program, traced_x, traced_w)
        torch.testing.assert_close(traced, expected, msg=f"{name} traced {chain}")
        traced_grads = tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (traced_x, traced_w))
        torch.testing.assert_close(traced_grads, expected_grads, msg=f"{name} traced gradients {chain}")


def _with_a_write_or_view(chain):
    return chain if any(name in VIEW_AND_WRITE_OPS for name in chain) else [*chain, "write_into_clone"]


# Each example compiles the three HOPs' programs, forward and backward, as one program (with
# inductor, seconds of g++ per kernel): few examples per run, a new draw each run.
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=chains.map(_with_a_write_or_view),
    seed=st.integers(0, 2**16),
    w_requires_grad=st.booleans(),
    backend=st.sampled_from(["aot_eager", "inductor"]),
)
def test_bodies_with_writes_and_views_compile_to_the_python_loop(chain, seed, w_requires_grad, backend):
    # A body writing into a tensor it made (``h = h.clone(); h[:, 0] = new``) while a closure
    # needs grad once compiled to wrong values: the traced joint dropped the write. Every body
    # HOP, under torch.compile's AOTAutograd backends, against the plain-torch loop, values and
    # gradients, with the closed-over weight requiring grad or not.
    # Every HOP's program in one compiled function, each on its own inputs.
    x, w = inputs(seed)
    cases = programs(chain)
    leaves = leaves_for(cases, x, w, w_requires_grad)
    torch._dynamo.reset()
    outputs = torch.compile(together([program for _, program, _ in cases]), backend=backend, fullgraph=True)(*leaves)
    sum(o.sum() for o in torch.utils._pytree.tree_leaves(outputs)).backward()
    for i, ((name, _, reference), got) in enumerate(zip(cases, outputs)):
        what = f"{name} {backend} w_requires_grad={w_requires_grad} {chain}"
        expected, expected_grads = gradients(reference, x, w, w_requires_grad)
        got_grads = tuple(gradient_of(t) for t in leaves[2 * i : 2 * i + 2] if t.requires_grad)
        torch.testing.assert_close(got, expected, msg=f"values {what}")
        torch.testing.assert_close(got_grads, expected_grads, msg=f"gradients {what}")


@TRACED_SETTINGS
@given(chain=chains, seed=st.integers(0, 2**16), p=st.sampled_from([0.2, 0.5]))
def test_random_bodies_with_dropout_differentiate_their_own_draws(chain, seed, p):
    # The body keeps its dropout mask as an output: whatever the draws, the gradient of the
    # kept values must be the mask's, in eager and traced runs (a recomputation that drew
    # again would differ).
    x, w = inputs(seed)

    def with_dropout(w):
        def body(t):
            kept = F.dropout(torch.ones_like(t), p)
            return make_body(chain, w)(t) * kept, kept

        return body

    region_placements = dict(mesh=LINE, in_placements=((Shard(0),),), out_placements=((Shard(0),), (Shard(0),)))
    programs_with_dropout = [
        ("local_map", lambda x, w: hops.local_map(with_dropout(w), **region_placements)(x)),
        ("named_scope", lambda x, w: hops.named_scope("dropout")(with_dropout(w))(x)),
    ]
    for name, program in programs_with_dropout:
        for traced in (False, True):
            torch.manual_seed(seed)
            inner = x.detach().clone().requires_grad_()
            if traced:
                _, _, (out, kept) = aot_trace(program, inner, w)
            else:
                out, kept = program(inner, w)
                (out.sum() + kept.sum()).backward()
            # Reference gradient for this mask: d(body(x) * kept)/dx with the same kept.
            reference_x = x.detach().clone().requires_grad_()
            (expected,) = torch.autograd.grad((make_body(chain, w)(reference_x) * kept.detach()).sum(), reference_x)
            torch.testing.assert_close(inner.grad, expected, msg=f"{name} traced={traced} {chain}")


@SETTINGS
@given(chain=chains, seed=st.integers(0, 2**16), where=st.integers(0, 4))
def test_a_write_into_an_input_is_refused_and_changes_nothing(chain, seed, where):
    x, w = inputs(seed)

    def writes(t):
        body = make_body(chain[:where], w)
        t.mul_(2)  # into the input (or the scan's slice / carry)
        return body(t) * 1

    calls = [
        lambda: hops.scan(lambda c, row: (writes(row) + c, None), torch.zeros(WIDTH, dtype=x.dtype), x),
        lambda: hops.local_map(writes, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))(x),
        lambda: hops.named_scope("writes")(writes)(x),
    ]
    before = x.clone()
    for call in calls:
        try:
            call()
        except ValueError as error:
            assert "writes into its input" in str(error), error
        else:
            raise AssertionError("a write into an input was not refused")
        torch.testing.assert_close(x, before)


# --------------------------------------------------------------------------- one tensor, many roles


def aliasing_programs(chain, roles):
    """(name, program(x, w), reference(x, w)): each HOP reads ``x`` in several roles at
    once (as two operands, and from its closure), which a trace must keep apart."""
    twice, closure = "second_operand" in roles, "closure" in roles

    def combine(t, other, x):
        if other is not None:
            t = t + other.sum(0)
        if closure:
            t = t * x.mean()
        return t

    def scan_program(x, w):
        body = make_body(chain, w)

        def step(c, row, *more):
            return body(combine(c + row, more[0] if more else None, x)), c.sum()

        return hops.scan(step, x, x, additional_inputs=(x,) if twice else ())

    def scan_reference(x, w):
        body, c, ys = make_body(chain, w), x, []
        for row in x:
            c, y = body(combine(c + row, x if twice else None, x)), c.sum()
            ys.append(y)
        return c, torch.stack(ys)

    def region_program(x, w):
        body = make_body(chain, w)
        placements = ((Shard(0),), (Replicate(),)) if twice else ((Shard(0),),)
        region = hops.local_map(
            lambda a, *b: body(combine(a, b[0] if b else None, x)),
            mesh=LINE,
            in_placements=placements,
            out_placements=(Shard(0),),
        )
        return region(x, x) if twice else region(x)

    def scope_program(x, w):
        body = make_body(chain, w)
        scope = hops.named_scope("aliased")(lambda a, *b: body(combine(a, b[0] if b else None, x)))
        return scope(x, x) if twice else scope(x)

    def plain(x, w):
        return make_body(chain, w)(combine(x, x if twice else None, x))

    return [("scan", scan_program, scan_reference), ("local_map", region_program, plain), ("named_scope", scope_program, plain)]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=chains,
    seed=st.integers(0, 2**16),
    roles=st.sets(st.sampled_from(["second_operand", "closure"]), min_size=1),
)
def test_one_tensor_in_several_roles_is_several_inputs_on_every_frontend(chain, seed, roles):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = inputs(seed)
    cases, expectations = aliasing_programs(chain, sorted(roles)), []
    for name, program, reference in cases:
        what = f"{name} {sorted(roles)} {chain}"
        expected, expected_grads = gradients(reference, x, w)
        expectations.append((what, expected, expected_grads))
        # A chain of squares over a scan's steps can overflow: NaN compares unequal to itself.
        assume(all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_leaves((expected, expected_grads))))
        got, got_grads = gradients(program, x, w)
        torch.testing.assert_close(got, expected, msg=f"eager {what}")
        torch.testing.assert_close(got_grads, expected_grads, msg=f"eager gradients {what}")
        for mode in ("real", "fake"):
            traced = make_fx(program, tracing_mode=mode)(x, w)
            torch.testing.assert_close(traced(x, w), expected, msg=f"make_fx {mode} {what}")
    # AOTAutograd and Dynamo trace every HOP's program at once, each on its own inputs (``x``
    # in several roles within each).
    for frontend in ("aot", "dynamo"):
        leaves = leaves_for(cases, x, w)
        everything = together([program for _, program, _ in cases])
        if frontend == "aot":
            *_, outputs = aot_trace(everything, *leaves)
        else:
            torch._dynamo.reset()
            _, outputs = compile_trace(everything, *leaves)
        for i, (what, expected, expected_grads) in enumerate(expectations):
            torch.testing.assert_close(outputs[i], expected, msg=f"{frontend} {what}")
            grads = tuple(gradient_of(t) for t in leaves[2 * i : 2 * i + 2])
            torch.testing.assert_close(grads, expected_grads, msg=f"{frontend} gradients {what}")


# --------------------------------------------------------------------------- unused inputs


def _unused_programs(used):
    """A body reading the inputs ``used`` (a tuple of bools, one per input) in each HOP, and
    its Python; every input requires grad."""

    def body(*ts):
        picked = [t for t, u in zip(ts, used) if u]
        return sum((t.sin() for t in picked), torch.zeros_like(ts[0]))

    region = hops.local_map(body, mesh=LINE, in_placements=tuple((Shard(0),) for _ in used), out_placements=((Shard(0),),))
    scope = hops.named_scope("unused")(body)

    def scanned(*ts):
        c, ys = hops.scan(lambda c, xs: (c + body(*xs), body(*xs).sum()), torch.zeros_like(ts[0][0]), ts)
        return c.sum() + ys.sum()

    def scanned_reference(*ts):
        c, total = torch.zeros_like(ts[0][0]), 0
        for i in range(ts[0].shape[0]):
            step = body(*(t[i] for t in ts))
            c, total = c + step, total + step.sum()
        return c.sum() + total

    return {"local_map": (region, body), "named_scope": (scope, body), "scan": (scanned, scanned_reference)}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    used=st.lists(st.booleans(), min_size=1, max_size=4),
    hop=st.sampled_from(["local_map", "named_scope", "scan"]),
    compiled=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_an_input_no_output_depends_on_gets_no_gradient_as_in_python(used, hop, compiled, seed):
    # None, not zeros, eager and through AOTAutograd: an optimizer steps a parameter with a
    # zero gradient (momentum, weight decay) and skips one without.
    assume(any(used))  # (with none, the output is a constant: nothing to differentiate)
    program, reference = _unused_programs(tuple(used))[hop]
    if compiled:
        torch._dynamo.reset()
        program = torch.compile(program, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(4, WIDTH, generator=g, dtype=torch.float64) for _ in used]
    got_inputs = [v.clone().requires_grad_() for v in values]
    expected_inputs = [v.clone().requires_grad_() for v in values]
    program(*got_inputs).sum().backward()
    reference(*expected_inputs).sum().backward()
    for got, expected in zip(got_inputs, expected_inputs):
        assert (got.grad is None) == (expected.grad is None)
        if expected.grad is not None:
            torch.testing.assert_close(got.grad, expected.grad)
