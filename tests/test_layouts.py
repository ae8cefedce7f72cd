"""Property tests: what reaches a body is laid out otherwise than the stand-ins it was traced on.

A body is traced once, on stand-ins, and its graph keeps what the trace decided from their
layout (a ``view`` where the stand-in allowed one). The contract (``hops._body_hop.body.at_boundary``):
every body HOP makes its body's operands, and its own results, contiguous. These tests
generate programs whose operands, carries, gradients and saved tensors are laid out every way
a user's program lays them out:

- operands expanded (stride 0), transposed, sliced with an offset, channels-last;
- the gradient of a ``.sum()`` loss inside the compiled function (an expanded carry);
- steps whose saved tensors are SDPA outputs (permuted on CPU) and ``.contiguous()`` copies of
  permuted views, read back by ``view`` in the backward;

through every frontend (eager; ``make_fx`` real / fake / symbolic; AOTAutograd;
``torch.export``; ``torch.compile`` with ``aot_eager`` and inductor, the loss inside and
outside), forward values and gradients against the same program written as a Python loop.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops

B, S, HEADS, HEAD_DIM = 2, 4, 2, 4
D = HEADS * HEAD_DIM
LENGTH = 3

# --------------------------------------------------------------------------- layouts
#
# Each makes a leaf tensor of ``shape`` with the values of ``torch.randn(shape)`` drawn from
# ``generator`` (constant along dim 0 for "expanded") and the named layout.


def _values(shape, generator, expanded=False):
    if expanded:
        return torch.randn((1, *shape[1:]), generator=generator).expand(shape)
    return torch.randn(shape, generator=generator)


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "contiguous":
        out = values.contiguous()
    elif layout == "expanded":
        out = values  # made by expand: stride 0 on dim 0
    elif layout == "transposed":  # the last two dims swapped in memory
        out = values.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "offset":  # a slice of a wider tensor, at an offset, every dim strided
        wide = torch.zeros(*values.shape[:-1], values.shape[-1] + 3)
        wide[..., 2 : 2 + values.shape[-1]] = values
        out = wide[..., 2 : 2 + values.shape[-1]]
    elif layout == "channels_last":
        out = _channels_last(values)
    else:
        raise AssertionError(layout)
    assert torch.equal(out, values)
    return out.detach().requires_grad_(values.is_floating_point())


def _channels_last(values: torch.Tensor) -> torch.Tensor:
    """``values`` whose memory walks the last dim first of the dims after the first
    (channels-last of a 4-d tensor; the same permutation for 3-d and 2-d)."""
    if values.dim() < 3:
        return values.t().contiguous().t() if values.dim() == 2 else values.contiguous()
    order = [0, *range(2, values.dim()), 1]
    back = sorted(range(values.dim()), key=order.__getitem__)
    return values.permute(order).contiguous().permute(back)


LAYOUTS = ["contiguous", "expanded", "transposed", "offset", "channels_last"]

# --------------------------------------------------------------------------- steps
#
# A step ``(h, x, w) -> (new h, y)`` on ``h`` of shape (B, S, D), ``x`` one slice of the xs,
# ``w`` a (D, D) weight. Each reads its operands through views whose validity depends on
# layout, and saves tensors whose layout is not contiguous.


def residual_step(h, x, w):
    h = h + torch.tanh(h @ w + x)
    return h, h.sum(-1)


def attention_step(h, x, w):
    """torchtitan's attention: heads split by a view, SDPA (its CPU output is permuted), the
    heads merged by ``transpose(1, 2).contiguous().flatten(2)`` (no copy on that layout)."""
    q = (h + x).view(*h.shape[:2], HEADS, HEAD_DIM).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    o = o.transpose(1, 2).contiguous().flatten(2) @ w
    return h + o, o.mean(-1)


def permuted_copy_step(h, x, w):
    """A ``.contiguous()`` of a permuted view, saved and flattened by a view."""
    t = torch.tanh(h.permute(0, 2, 1)).contiguous().permute(0, 2, 1)
    return h + (t * x).flatten(1).view(h.shape) @ w, t.flatten(1)


STEPS = {"residual": residual_step, "attention": attention_step, "permuted_copy": permuted_copy_step}


def python_scan(step, init, xs, additional):
    carry, ys = init, []
    for i in range(xs.shape[0]):
        carry, y = step(carry, xs[i], *additional)
        ys.append(y)
    return carry, torch.stack(ys)


def hops_scan(step, init, xs, additional):
    return hops.scan(step, init, xs, additional_inputs=tuple(additional))


def scan_loss(scan_impl, step, h, xs, w):
    last, ys = scan_impl(step, h, xs, (w,))
    return last.sum() + ys.sum()


def region_loss(region_impl, step, h, xs, w):
    """A named scope around one step, then a local_map of the same step over rows."""
    if region_impl is None:
        first, _ = step(h, xs[0], w)
        second, _ = step(first, xs[1], w)
    else:
        first = hops.named_scope("block")(lambda h, x, w: step(h, x, w)[0])(h, xs[0], w)
        mesh = hops.Mesh.of(rows=2)
        second = hops.local_map(
            lambda h, x, w: step(h, x, w)[0],
            out_placements=((hops.Shard(0),),),
            in_placements=((hops.Shard(0),), (hops.Shard(0),), (hops.Replicate(),)),
            mesh=mesh,
        )(first, xs[1], w)
    return second.square().sum()


def make_args(layouts, seed, length=LENGTH):
    generator = torch.Generator().manual_seed(seed)
    shapes = {"h": (B, S, D), "xs": (length, B, S, D), "w": (D, D)}
    values = {k: _values(shape, generator, layouts[k] == "expanded") for k, shape in shapes.items()}
    values["w"] = values["w"] / D
    return [_laid_out(values[k], layouts[k]) for k in ("h", "xs", "w")]


def reference(loss_fn, args):
    """The Python program's loss and gradients (eager, on contiguous copies of ``args``)."""
    copies = [a.detach().clone().requires_grad_() for a in args]
    loss = loss_fn(*copies)
    return loss.detach(), torch.autograd.grad(loss, copies)


# --------------------------------------------------------------------------- frontends


def _grads_of(fn):
    def train(*args):
        loss = fn(*args)
        return (loss, *torch.autograd.grad(loss, args))

    return train


def run_eager(fn, args):
    loss = fn(*args)
    return loss.detach(), torch.autograd.grad(loss, args)


def run_make_fx(mode, fn, args):
    gm = make_fx(_grads_of(fn), tracing_mode=mode)(*args)
    loss, *grads = gm(*args)
    return loss, grads


def run_aot(fn, args):
    from functorch.compile import aot_function, nop

    loss = aot_function(fn, fw_compiler=nop, bw_compiler=nop)(*args)
    return loss.detach(), torch.autograd.grad(loss, args)


def run_export(fn, args):
    class Program(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    exported = torch.export.export(Program(), tuple(a.detach() for a in args))
    return exported.module()(*args).detach(), None


def run_compile(backend, loss_inside, fn, args):
    torch._dynamo.reset()
    if loss_inside:
        loss = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    else:
        # The compiled function returns what the loss is made of; the loss is taken outside.
        loss = torch.compile(lambda *a: fn(*a) * 1.0, backend=backend, fullgraph=True)(*args).sum()
    return loss.detach(), torch.autograd.grad(loss, args)


CHEAP_FRONTENDS = {
    "eager": run_eager,
    "make_fx_real": functools.partial(run_make_fx, "real"),
    "make_fx_fake": functools.partial(run_make_fx, "fake"),
    "make_fx_symbolic": functools.partial(run_make_fx, "symbolic"),
    "aot_autograd": run_aot,
    "export": run_export,
}


def check(frontend, loss_fn, program, args):
    expected_loss, expected_grads = reference(loss_fn, args)
    loss, grads = frontend(program, args)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-4)
    if grads is not None:
        for got, expected in zip(grads, expected_grads):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


layouts_st = st.fixed_dictionaries({k: st.sampled_from(LAYOUTS) for k in ("h", "xs", "w")})


# An example traces one program (up to seconds with ``make_fx``'s symbolic tracing): each
# frontend and step meets a few draws of layouts a run, a new draw each run.
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
@given(
    step=st.sampled_from(sorted(STEPS)),
    frontend=st.sampled_from(sorted(CHEAP_FRONTENDS)),
    layouts=layouts_st,
    seed=st.integers(0, 2**16),
)
def test_scan_any_layout_any_tracer_matches_python_loop(step, frontend, layouts, seed):
    args = make_args(layouts, seed)
    check(
        CHEAP_FRONTENDS[frontend],
        functools.partial(scan_loss, python_scan, STEPS[step]),
        functools.partial(scan_loss, hops_scan, STEPS[step]),
        args,
    )


# A region example traces two body HOPs (a named scope, a local_map run per device), seconds
# with ``make_fx``'s symbolic tracing: fewer examples than the scan's, a new draw each run (the
# compiled tests below hold fixed region layouts).
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
@given(
    step=st.sampled_from(sorted(STEPS)),
    frontend=st.sampled_from(sorted(CHEAP_FRONTENDS)),
    layouts=layouts_st,
    seed=st.integers(0, 2**16),
)
def test_regions_any_layout_any_tracer_match_plain_program(step, frontend, layouts, seed):
    args = make_args(layouts, seed, length=2)
    check(
        CHEAP_FRONTENDS[frontend],
        functools.partial(region_loss, None, STEPS[step]),
        functools.partial(region_loss, True, STEPS[step]),
        args,
    )


# torch.compile: each case compiles the forward and backward (seconds), so a fixed set covers
# each step with the layouts that break a trace (expanded, permuted, offset) and the loss
# both inside (its gradient enters the backward loop expanded) and outside.
COMPILED_CASES = [
    ("residual", "inductor", True, {"h": "contiguous", "xs": "contiguous", "w": "contiguous"}),
    ("residual", "inductor", False, {"h": "expanded", "xs": "transposed", "w": "transposed"}),
    ("attention", "inductor", True, {"h": "offset", "xs": "channels_last", "w": "contiguous"}),
    ("attention", "aot_eager", False, {"h": "transposed", "xs": "expanded", "w": "offset"}),
    ("permuted_copy", "inductor", True, {"h": "channels_last", "xs": "offset", "w": "expanded"}),
    ("permuted_copy", "aot_eager", True, {"h": "contiguous", "xs": "transposed", "w": "contiguous"}),
]


@pytest.mark.parametrize("step,backend,loss_inside,layouts", COMPILED_CASES, ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(v.values()))
def test_compiled_scan_any_layout_matches_python_loop(step, backend, loss_inside, layouts):
    args = make_args(layouts, seed=0)
    check(
        functools.partial(run_compile, backend, loss_inside),
        functools.partial(scan_loss, python_scan, STEPS[step]),
        functools.partial(scan_loss, hops_scan, STEPS[step]),
        args,
    )


@pytest.mark.parametrize("step", ["residual", "attention"])
def test_compiled_regions_with_loss_inside_match_plain_program(step):
    args = make_args({"h": "transposed", "xs": "expanded", "w": "offset"}, seed=1, length=2)
    check(
        functools.partial(run_compile, "inductor", True),
        functools.partial(region_loss, None, STEPS[step]),
        functools.partial(region_loss, True, STEPS[step]),
        args,
    )


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("layout", LAYOUTS)
def test_results_are_laid_out_as_the_fake_rule_says(layout):
    """Each body HOP's eager results have the strides its fake rule gives (contiguous): a
    compiler that plans memory from the fake rule reads what the eager kernel wrote."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    h, xs, w = (a.detach() for a in make_args({"h": layout, "xs": layout, "w": layout}, seed=2))

    def transposed_step(h, x, w):
        return (h + x).transpose(-1, -2).transpose(-1, -2) * 1.0, (h @ w).transpose(0, 1)

    programs = {
        "scan": lambda h, xs, w: hops.scan(transposed_step, h, xs, additional_inputs=(w,)),
        "named_scope": lambda h, xs, w: hops.named_scope("s")(lambda h, w: ((h @ w).transpose(0, 1), h[:, :1].expand(B, S, D)))(h, w),
    }
    for name, program in programs.items():
        eager = program(h, xs, w)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = program(mode.from_tensor(h), mode.from_tensor(xs), mode.from_tensor(w))
        for got, said in zip(eager, fake):
            assert got.is_contiguous(), (name, got.stride())
            assert got.stride() == said.stride(), (name, got.stride(), said.stride())
