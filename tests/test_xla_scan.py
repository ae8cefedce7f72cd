"""Scans lowered to one XLA While on 4 CPU devices, with the body's custom calls inside."""

import re

import pytest
import torch

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import aot_trace, device, hlo_text

pytestmark = pytest.mark.xla

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))


def sync():
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def computations(hlo):
    """HLO computation name -> its text (ENTRY included)."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo)
    return {re.match(r"(?:ENTRY )?%([\w.\-]+)", b).group(1): b for b in blocks if re.match(r"(?:ENTRY )?%", b)}


def loop_body_calls(hlo):
    """(number of whiles, custom-call targets in computations reachable from while bodies)."""
    comps = computations(hlo)
    whiles = re.findall(r" while\(.*body=%([\w.\-]+)", hlo)
    seen, stack = set(), list(whiles)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        stack += re.findall(r"(?:to_apply|calls|body|condition)=%([\w.\-]+)", comps[name])
    targets = [t for name in seen for t in re.findall(r'custom_call_target="(\w+)"', comps[name])]
    return len(whiles), sorted(targets)


def annotated_step(h, x, w):
    h = hops.annotate_sharding(torch.tanh(h @ w + x), ROWS)
    return h, h.sum(-1)


def scan_loss(h, xs, w):
    last, ys = hops.scan(annotated_step, h, xs, additional_inputs=(w,))
    return last.sum() + ys.sum()


def inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 8, requires_grad=True), torch.randn(6, 4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)]


def lowered_aot(fn, args):
    forward, backward, reference = aot_trace(fn, *args)
    reference_grads = torch.autograd.grad(fn(*args), args)
    return passes.lower_to_xla(forward), passes.lower_to_xla(backward), reference, reference_grads


def run_lowered(forward, backward, args):
    out, *saved = forward(*(a.detach().to(device()) for a in args))
    forward_hlo = hlo_text(out)
    sync()
    grads = backward(*saved, torch.ones((), device=device()))
    return out, grads, forward_hlo, hlo_text(*grads)


def test_scan_is_one_while_with_the_annotation_in_its_body_forward_and_backward():
    args = inputs()
    forward, backward, reference, reference_grads = lowered_aot(scan_loss, args)
    out, grads, forward_hlo, backward_hlo = run_lowered(forward, backward, args)
    assert loop_body_calls(forward_hlo) == (1, ["Sharding"])
    assert loop_body_calls(backward_hlo) == (1, ["Sharding"])
    # Not unrolled: one annotation in the HLO, inside the loop, for 6 steps.
    assert forward_hlo.count('custom_call_target="Sharding"') == 1
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-4, atol=1e-4)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-4, atol=1e-4)



def test_scan_called_on_xla_tensors_is_one_while_forward_and_backward():
    """hops.scan called eagerly on XLA tensors (as torch_xla's scan is) runs the While that
    lower_to_xla makes, with the annotation inside it, not a Python loop XLA would unroll."""
    args = inputs()
    reference = scan_loss(*args)
    reference_grads = torch.autograd.grad(reference, args)
    on_xla = [a.detach().to(device()).requires_grad_() for a in args]
    out = scan_loss(*on_xla)
    forward_hlo = hlo_text(out)
    grads = torch.autograd.grad(out, on_xla)
    assert loop_body_calls(forward_hlo) == (1, ["Sharding"])
    assert forward_hlo.count('custom_call_target="Sharding"') == 1 and forward_hlo.count(" tanh(") == 1
    # The gradients' graph holds the forward loop (its saved values) and the reverse loop.
    assert loop_body_calls(hlo_text(*grads)) == (2, ["Sharding", "Sharding"])
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-4, atol=1e-4)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_a_region_in_a_scan_called_on_xla_tensors_runs_forward_and_backward():
    args = inputs()
    reference = region_loss(*args)
    reference_grads = torch.autograd.grad(reference, args)
    on_xla = [a.detach().to(device()).requires_grad_() for a in args]
    out = region_loss(*on_xla)
    assert loop_body_calls(hlo_text(out)) == (1, ["SPMDFullToShardShape", "SPMDShardToFullShape", "Sharding", "Sharding"])
    grads = torch.autograd.grad(out, on_xla)
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-3, atol=1e-3)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-3, atol=1e-3)


def test_a_scan_on_xla_tensors_follows_its_inputs_and_refuses_mixed_devices():
    from hops.scan import ScanSpec

    def step(c, x):
        return c * 0.5 + x, c.sum()

    for n, reverse in ((4, False), (8, True)):
        spec = ScanSpec(num_carry=1, num_xs=1, length=3, reverse=reverse)
        c, xs = torch.randn(n), torch.randn(3, n)
        expected_last, expected_ys = hops.scan_hop(step, c, xs, spec)  # CPU: the Python loop
        last, ys = hops.scan_hop(step, c.to(device()), xs.to(device()), spec)
        assert loop_body_calls(hlo_text(last, ys))[0] == 1
        torch.testing.assert_close(last.cpu(), expected_last)
        torch.testing.assert_close(ys.cpu(), expected_ys)
    with pytest.raises(ValueError, match=r"^scan\(step\): xs\[0\] is a cpu tensor; a scan on XLA tensors needs every input on the XLA device"):
        hops.scan_hop(step, torch.zeros(4, device=device()), torch.zeros(3, 4), spec)


SCAN_ON_XLA_WITHOUT_SPMD = """
import torch, torch_xla, hops
mesh = hops.Mesh((2, 2), ("data", "model"))
rows = hops.ShardingSpec(mesh, (hops.Shard(0), hops.Replicate()))
region = hops.local_map(lambda h: h * 2, mesh=mesh, in_placements=(rows.placements,), out_placements=rows.placements)
def annotated(h, x):
    h = hops.annotate_sharding(torch.tanh(h + x), rows)
    return h, h.sum(-1)
def with_region(h, x):
    return region(h + x), None
h, xs = torch.randn(4, 8), torch.randn(3, 4, 8)
last, ys = hops.scan(annotated, h.to("xla"), xs.to("xla"))
hlo = torch_xla._XLAC._get_xla_tensors_hlo([last, ys])
expected_last, expected_ys = hops.scan(annotated, h, xs)
# XLA:CPU's tanh and reductions differ from torch's in the last bits (by thread schedule).
close = dict(rtol=1e-5, atol=1e-5)
print(" while(" in hlo, "Sharding" in hlo, torch.allclose(last.cpu(), expected_last, **close), torch.allclose(ys.cpu(), expected_ys, **close))
try:
    hops.scan(with_region, h.to("xla"), xs.to("xla"))
except RuntimeError as e:
    print(e)
"""


def test_without_spmd_a_scan_on_xla_tensors_is_a_while_and_a_region_in_it_is_refused():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    result = subprocess.run([sys.executable, "-c", SCAN_ON_XLA_WITHOUT_SPMD], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # The annotation has no sharding to state without SPMD: it is the identity in the loop.
    assert result.stdout.splitlines()[-2:] == [
        "True False True True",
        "scan(with_region): a local_map region in a scan on XLA tensors runs as a manual-sharding region, "
        "which needs SPMD: call torch_xla.runtime.use_spmd() first",
    ]

def scale(h):
    return h * 2


region = hops.local_map(scale, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=(Shard(0), Replicate()))


def region_step(h, x, w):
    h = region(torch.tanh(h @ w + x))
    return h, h.sum(-1)


def region_loss(h, xs, w):
    last, ys = hops.scan(region_step, h, xs, additional_inputs=(w,))
    return last.sum() + ys.sum()


def test_a_local_map_region_in_a_scan_body_lowers_to_a_manual_region_inside_the_while():
    # The region's body multiplies by 2: torch_xla stages that scalar as device data, which
    # its own scan would make a loop operand (and abort on, see below); here it is a literal
    # of the loop body, and nothing manual crosses the loop boundary.
    args = inputs()
    forward, backward, reference, reference_grads = lowered_aot(region_loss, args)
    out, grads, forward_hlo, backward_hlo = run_lowered(forward, backward, args)
    # Forward: one While whose body enters and leaves the manual region once per step.
    assert loop_body_calls(forward_hlo) == (1, ["SPMDFullToShardShape", "SPMDShardToFullShape", "Sharding", "Sharding"])
    # Backward: the reverse scan's body runs the backward region (inputs: the saved region
    # input and the cotangent; output: the input's gradient); the values crossing the loop
    # boundary are global tensors.
    assert loop_body_calls(backward_hlo) == (
        1, ["SPMDFullToShardShape", "SPMDFullToShardShape", "SPMDShardToFullShape", "Sharding", "Sharding", "Sharding"]
    )
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-3, atol=1e-3)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-3, atol=1e-3)


def test_unrolled_scan_with_a_region_runs_forward_and_backward_on_xla():
    args = inputs()
    forward, backward, reference = aot_trace(region_loss, *args)
    reference_grads = torch.autograd.grad(region_loss(*args), args)
    forward = passes.lower_to_xla(passes.unroll_scan(forward))
    backward = passes.lower_to_xla(passes.unroll_scan(backward))
    out, grads, forward_hlo, backward_hlo = run_lowered(forward, backward, args)
    assert " while(" not in forward_hlo and forward_hlo.count('"SPMDFullToShardShape"') == 6
    # The region doubles h at every step: float32 error grows over the 6 steps (~6e-4 seen).
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-3, atol=1e-3)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-3, atol=1e-3)


def test_a_region_in_a_remat_scan_runs_forward_and_backward():
    # remat: the forward saves only carries; the backward step recomputes the region.
    def loss(h, xs, w):
        last, ys = hops.scan(region_step, h, xs, additional_inputs=(w,), remat=True)
        return last.sum() + ys.sum()

    args = inputs()
    forward, backward, reference, reference_grads = lowered_aot(loss, args)
    out, grads, forward_hlo, backward_hlo = run_lowered(forward, backward, args)
    assert loop_body_calls(forward_hlo)[0] == 1 and loop_body_calls(backward_hlo)[0] == 1
    assert "SPMDFullToShardShape" in loop_body_calls(backward_hlo)[1]
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-3, atol=1e-3)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-3, atol=1e-3)


def lowered(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return passes.lower_to_xla(make_fx(fn)(*args))


def cumulative(c, x):
    c = c * 0.5 + x
    return c, c.sum()


def test_reverse_scan_matches_eager():
    def fn(h, xs):
        return hops.scan(cumulative, h, xs, reverse=True)

    h, xs = torch.randn(4), torch.randn(5, 4)
    (last, ys), (expected_last, expected_ys) = lowered(fn, h, xs)(h.to(device()), xs.to(device())), fn(h, xs)
    torch.testing.assert_close(last.cpu(), expected_last)
    torch.testing.assert_close(ys.cpu(), expected_ys)


def test_scan_with_only_a_length_and_no_ys_matches_eager():
    def count(c, _):
        return c * 3 + 1, None

    def fn(h):
        last, ys = hops.scan(count, h, None, length=4)
        assert ys is None
        return last

    h = torch.randn(3)
    torch.testing.assert_close(lowered(fn, h)(h.to(device())).cpu(), fn(h))


def test_each_step_and_each_call_draws_its_own_random_numbers():
    def noisy(c, x):
        y = torch.nn.functional.dropout(x, 0.5, training=True)
        return c + y.sum(), y

    def fn(h, xs):
        return hops.scan(noisy, h, xs)

    h, xs = torch.zeros(()), torch.ones(6, 64)
    gm = lowered(fn, h, xs)
    _, first = gm(h.to(device()), xs.to(device()))
    _, second = gm(h.to(device()), xs.to(device()))
    first, second = first.cpu(), second.cpu()
    assert set(first.unique().tolist()) <= {0.0, 2.0}
    # Equal masks by chance: 2**-64 per pair of rows.
    assert len({tuple(row.tolist()) for row in first}) == 6
    assert not torch.equal(first, second)


def test_a_step_is_staged_once_per_input_layout_and_reads_what_it_closes_over():
    from passes.xla.staging import LITERAL_ELEMENTS
    from passes.xla.while_loop import xla_while

    big = torch.randn(LITERAL_ELEMENTS + 1)
    small = torch.randn(3)
    staged = []

    def step(c, x):
        staged.append(tuple(c.shape))
        # Closed-over XLA tensors are hoisted: the small one becomes a literal of the loop
        # body, the big one a loop-invariant operand.
        new = c + x[: c.shape[0]] * big_xla[: c.shape[0]] + small_xla.sum()
        return new, new.sum()

    big_xla, small_xla = big.to(device()), small.to(device())
    for n in (4, 4, 8):
        c, xs = torch.randn(n), torch.randn(5, LITERAL_ELEMENTS + 1)
        last, ys = xla_while(step, [c.to(device())], [xs.to(device())], [], length=5)
        expected, expected_ys = c, []
        for x in xs:
            expected = expected + x[:n] * big[:n] + small.sum()
            expected_ys.append(expected.sum())
        torch.testing.assert_close(last.cpu(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ys.cpu(), torch.stack(expected_ys), rtol=1e-5, atol=1e-4)
    assert staged == [(4,), (8,)]


def test_a_step_that_returns_no_flat_tensors_is_refused_before_staging():
    from passes.xla.while_loop import xla_while

    c, xs = torch.zeros(4, device=device()), torch.zeros(5, 4, device=device())
    with pytest.raises(TypeError, match=r"step lambda: \(\*new_carry, \*ys\): must return tensors, got a tuple at position 0"):
        xla_while(lambda c, x: ((c + x,), (c.sum(),)), [c], [xs], [], length=5)
    with pytest.raises(ValueError, match=r"carry\[0\] leaves the step as \(3,\) torch.float32, entered as \(4,\) torch.float32"):
        xla_while(lambda c, x: (c[:3], c.sum()), [c], [xs], [], length=5)


@pytest.mark.parametrize("reverse", [False, True])
def test_unroll_runs_several_steps_per_iteration_with_the_same_values(reverse):
    # As JAX's scan(unroll=k): length // k iterations of k steps, then the remainder.
    h, xs, w = (t.detach() for t in inputs())
    expected = hops.scan(annotated_step, h, xs, additional_inputs=(w,), reverse=reverse)
    for unroll in (1, 2, 4, 6, True):
        last, ys = hops.scan(
            annotated_step, h.to(device()), xs.to(device()), additional_inputs=(w.to(device()),), reverse=reverse, unroll=unroll
        )
        hlo = hlo_text(last, ys)
        comps = computations(hlo)
        (body,) = re.findall(r" while\(.*body=%([\w.\-]+)", hlo)
        steps_per_iteration = len(re.findall(r" call\(", comps[body]))
        length, k = 6, (6 if unroll is True else unroll)
        assert steps_per_iteration == k, (unroll, steps_per_iteration)
        # The steps after the loop: one call each, outside the While.
        outside = sum(len(re.findall(r" call\(", text)) for name, text in comps.items() if name != body and "while(" in text)
        assert outside == length % k, (unroll, outside)
        torch.testing.assert_close(last.cpu(), expected[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ys.cpu(), expected[1], rtol=1e-4, atol=1e-4)


def plain_step(h, x, w):
    h = torch.tanh(h @ w + x)
    return h, h.sum(-1)


def defined_as(computation):
    """Instruction name -> its defining text, in one computation's HLO."""
    return dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", computation, re.M))


@pytest.mark.parametrize("reverse", [False, True])
def test_a_scan_loop_holds_its_values_only_and_slices_at_its_counter(reverse):
    # What XLA compiles for a scan: the loop state is the counter, the carry, the xs, the
    # ys buffers and the additional inputs, nothing else; every slice read and written is at
    # the counter itself (a reverse loop counts down: no ``length - 1 - i`` fused into each
    # slice, which would make the backward's slices kernels of their own); and the call
    # takes the caller's tensors only: the ys buffers start as zeros the computation makes
    # (a buffer from the host would be a transfer on every call).
    h, xs, w = torch.randn(4, 8), torch.randn(6, 4, 8), torch.randn(8, 8)
    expected = hops.scan(plain_step, h, xs, additional_inputs=(w,), reverse=reverse)
    last, ys = hops.scan(plain_step, h.to(device()), xs.to(device()), additional_inputs=(w.to(device()),), reverse=reverse)
    hlo = hlo_text(last, ys)
    comps = computations(hlo)
    (body,) = re.findall(r" while\(.*body=%([\w.\-]+)", hlo)
    body_text = comps[body]
    (state,) = re.findall(r"^%[\w.\-]+ \(\w[\w.\-]*: \((.*?)\)\) ->", body_text, re.M)
    assert re.sub(r"\{[\d,]*\}|/\*index=\d+\*/", "", state).replace(" ", "").split(",f32") == [
        "s64[]", "[4,8]", "[6,4,8]", "[6,4]", "[8,8]"
    ]
    names = defined_as(body_text)
    (counter,) = (n for n, text in names.items() if re.match(r"s64\[\] get-tuple-element\(.*\), index=0$", text))
    slices = [text for text in names.values() if re.match(r"\S+ dynamic-(update-)?slice\(", text)]
    assert len(slices) == 2  # the x read, the y written
    for text in slices:
        first_index = re.search(r"s64\[\] %([\w.\-]+)", text).group(1)
        assert first_index == counter, text
    entry = next(text for name, text in comps.items() if text.startswith("ENTRY"))
    entry_names = defined_as(entry)
    (call,) = re.findall(r" call\((.*)\), to_apply=", entry)
    operands = re.findall(r"%([\w.\-]+)", call)
    assert len(operands) == 3 and all(" parameter(" in entry_names[o] for o in operands), call
    torch.testing.assert_close(last.cpu(), expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys.cpu(), expected[1], rtol=1e-5, atol=1e-5)


def test_every_length_and_unroll_runs_every_step_once():
    # XLA's loop analyses count trips from the loop's bound and increment; any miscount
    # shows as a step run twice or never. Steps add distinct powers of two: the sum says
    # exactly which ran.
    from passes.xla.while_loop import xla_while

    for length in range(1, 8):
        xs = (2.0 ** torch.arange(length, dtype=torch.float64)).reshape(length, 1)
        for unroll in range(1, length + 1):
            for reverse in (False, True):
                c = torch.zeros(1, dtype=torch.float64)
                last, ys = xla_while(
                    lambda c, x: (c + x, c + x), [c.to(device())], [xs.to(device())], [], length=length, reverse=reverse, unroll=unroll
                )
                order = xs.flip(0) if reverse else xs
                expected_ys = order.cumsum(0)
                assert last.cpu().item() == 2.0**length - 1, (length, unroll, reverse)
                torch.testing.assert_close(ys.cpu(), expected_ys.flip(0) if reverse else expected_ys, rtol=0, atol=0)


SCALAR_INSIDE_AND_OUTSIDE_A_REGION = """
import torch, torch_xla, torch_xla.runtime as xr, torch_xla.core.xla_model as xm
from functorch.compile import aot_function, make_boxed_func
import hops, passes
xr.use_spmd()
mesh = hops.Mesh.of(data=2, model=2)
tiles = (hops.Shard(0), hops.Shard(1))
region = hops.local_map(lambda q, k: q * 2 + k, mesh=mesh, in_placements=(tiles, tiles), out_placements=tiles)
def step(c, w):
    c = torch.rsqrt(c.pow(2) + 1.0)   # pow's backward multiplies by 2.0, as the region does
    return region(c @ w, c).tanh(), None
def loss(h, ws):
    c, _ = hops.scan(step, h, ws)
    return c.square().mean()
graphs = {}
keep = lambda name: (lambda gm, example: graphs.__setitem__(name, gm) or make_boxed_func(gm))
torch.manual_seed(0)
args = [torch.randn(4, 4, 8, requires_grad=True), (torch.randn(2, 8, 8) * 0.3).requires_grad_()]
aot_function(loss, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(*args).backward()
forward, backward = passes.lower_to_xla(graphs["forward"]), passes.lower_to_xla(graphs["backward"])
out = forward(*[a.detach().to("xla") for a in args])
torch_xla.sync(); xm.wait_device_ops()
grads = backward(*out[1:], torch.ones((), device="xla"))
torch_xla.sync(); xm.wait_device_ops()
expected = torch.autograd.grad(loss(*args), args)
print(all(torch.allclose(g.cpu(), e, rtol=1e-4, atol=1e-5) for g, e in zip(grads, expected)))
"""


def test_a_number_used_inside_and_outside_a_region_in_a_loop_compiles():
    # In its own process: XLA aborts the process when a shared scalar gets one sharding for
    # a manual and a non-manual use.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    result = subprocess.run([sys.executable, "-c", SCALAR_INSIDE_AND_OUTSIDE_A_REGION], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "True"


# --------------------------------------------------------------------------- tensor constants
#
# What tracing on the host makes of ``torch.tensor([...], device=x.device)``: a CPU constant
# (lifted to the top graph and passed to the bodies, or held by a body as a get_attr). Run on
# XLA tensors, every one of them must be on the XLA device.

LARGE = [i / 80 for i in range(80)]  # more elements than staging writes as a literal


def step_with_constants(h, x):
    scale = torch.tensor([1.0, 2.0, 0.5, -1.0], device=x.device)
    shift = torch.tensor(LARGE, device=x.device)[:4]
    h = torch.tanh(h * scale + x) + shift + torch.tensor(0.5, device=x.device)
    return h, h.sum()


def layer_with_constants(h, xs):
    h = h * torch.tensor([0.5, 1.0, 1.5, 2.0], device=xs.device)
    h, ys = hops.scan(step_with_constants, h, xs)
    return h, ys.sum()


def nested_with_constants(h, xss):
    last, totals = hops.scan(layer_with_constants, h, xss)
    return last * torch.tensor([1.0, -1.0, 1.0, -1.0], device=h.device), totals


def held_by_bodies(gm, levels):
    """``gm`` with each constant a scan passes its body (a trailing operand: a lifted
    ``get_attr``) held by the body instead, as a ``get_attr`` of its own, in the scans of the
    top ``levels`` graphs (1: the top graph's scans; a body's scan still gets its constants
    as operands, from its caller's get_attr)."""
    modules = [m for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule) and (name.count(".") + bool(name)) < levels]
    for module in modules:
        for node in list(module.graph.find_nodes(op="call_function", target=hops.scan_hop)):
            body = getattr(module, node.args[0].target)
            placeholders = list(body.graph.find_nodes(op="placeholder"))
            operands = list(node.args[1:-1])
            while operands:
                source = operands[-1]
                if source.op == "call_function" and source.target is torch.ops.aten.lift_fresh_copy.default:
                    source = source.args[0]
                if source.op != "get_attr":
                    break
                placeholder = placeholders.pop()
                name = f"held_{placeholder.name}"
                body.register_buffer(name, getattr(module, source.target).clone())
                with body.graph.inserting_before(placeholder):
                    held = body.graph.get_attr(name)
                placeholder.replace_all_uses_with(held)
                body.graph.erase_node(placeholder)
                operands.pop()
            node.args = (node.args[0], *operands, node.args[-1])
            body.recompile()
        module.graph.eliminate_dead_code()
        module.recompile()
    return gm


def constants_on_xla_inputs():
    torch.manual_seed(0)
    return torch.randn(4), torch.randn(3, 5, 4)


@pytest.mark.parametrize("levels", [0, 1, 2], ids=["lifted", "held_by_the_outer_body", "held_by_every_body"])
def test_tensor_constants_of_every_graph_run_on_the_xla_device(levels):
    from torch.fx.experimental.proxy_tensor import make_fx

    h, xss = constants_on_xla_inputs()
    gm = held_by_bodies(make_fx(nested_with_constants)(h, xss), levels)
    bodies = [m for name, m in gm.named_modules() if "body" in name]
    # Each body holds its own constants from ``levels`` on (the outer body's first one is
    # the inner step's when the inner body holds none).
    held = [[n for n in body.graph.find_nodes(op="get_attr") if isinstance(getattr(body, n.target), torch.Tensor)] for body in bodies]
    assert [len(constants) for constants in held] == [[0, 0], [4, 0], [1, 3]][levels]
    passes.lower_to_xla(gm)
    last, totals = gm(h.to(device()), xss.to(device()))
    assert loop_body_calls(hlo_text(last, totals))[0] == 2  # the outer While and the inner one
    expected_last, expected_totals = nested_with_constants(h, xss)
    torch.testing.assert_close(last.cpu(), expected_last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(totals.cpu(), expected_totals, rtol=1e-5, atol=1e-5)


def test_tensor_constants_of_forward_and_backward_graphs_run_on_the_xla_device():
    def loss(h, xss):
        last, totals = nested_with_constants(h, xss)
        return last.sum() + totals.sum()

    args = [t.requires_grad_() for t in constants_on_xla_inputs()]
    forward, backward, reference, reference_grads = lowered_aot(loss, args)
    out, grads, _, _ = run_lowered(forward, backward, args)
    torch.testing.assert_close(out.cpu(), reference.detach(), rtol=1e-4, atol=1e-4)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad.cpu(), expected, rtol=1e-4, atol=1e-4)


def made_with_the_inputs_device(h, xss):
    """Positions and a mask made with ``device=h.device`` (as models make them), in the program,
    in a scan step and in a region: traced on CPU, the factory ops say ``device=cpu``."""
    region = hops.local_map(
        lambda x: x * torch.arange(x.shape[-1], device=x.device),
        mesh=MESH,
        in_placements=((Shard(0), Replicate()),),
        out_placements=((Shard(0), Replicate()),),
    )

    def step(c, x):
        keep = torch.ones(x.shape, device=x.device).tril()
        c = c + region(x * keep).sum(0)
        return c, torch.full((2,), 3.0, device=c.device) * c.sum()

    scale = torch.arange(1, h.shape[0] + 1, device=h.device, dtype=h.dtype)
    return hops.scan(step, h * scale, xss)


def test_factory_ops_traced_with_the_hosts_device_run_on_the_xla_device():
    from torch.fx.experimental.proxy_tensor import make_fx

    h, xss = torch.randn(4), torch.randn(3, 4, 4)
    gm = make_fx(made_with_the_inputs_device)(h, xss)
    on_host = [
        n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
        if n.op == "call_function" and n.kwargs.get("device") == torch.device("cpu")
    ]
    assert len(on_host) >= 4, on_host  # the program's, the step's two and the region's
    passes.lower_to_xla(gm)
    assert not [
        n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
        if n.op == "call_function" and n.kwargs.get("device") == torch.device("cpu")
    ]
    last, ys = gm(h.to(device()), xss.to(device()))
    expected_last, expected_ys = made_with_the_inputs_device(h, xss)
    torch.testing.assert_close(last.cpu(), expected_last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys.cpu(), expected_ys, rtol=1e-5, atol=1e-5)
