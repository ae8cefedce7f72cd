"""apply_placements, format_placements, draw_placements; and the applied solution run on 4 XLA
CPU devices, equal to single-device eager, with the chosen shardings in the HLO."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec
from passes.solver import CostModel
from tests.helpers.snapshot import TestCase, aot_trace, hlo_text, readable

LINE = Mesh((2,), ("data",))
GRID = Mesh((2, 2), ("data", "model"))
R, S0, S1 = Replicate(), Shard(0), Shard(1)
SLOW_LINK = CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6)
FAST_LINK = CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e12, link_latency=1e-6)
ROWS = ShardingSpec(LINE, (S0,))
COLUMNS = ShardingSpec(LINE, (S1,))


def rows_program(x, w):
    return (hops.annotate_sharding(x, ROWS) @ w).relu()


def contracted_program(x, w):
    """x split along the contracted dim: the product is a pending sum that relu cannot read."""
    return (hops.annotate_sharding(x, COLUMNS) @ hops.annotate_sharding(w, ROWS)).relu()


def annotations(gm):
    return [
        (node.args[0].name, node.args[1].placements)
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target is hops.sharding_annotation_hop
    ]


class TestApply(TestCase):
    def test_each_placed_value_is_stated_after_it_is_made(self):
        args = (torch.randn(64, 32), torch.randn(32, 16))
        gm = make_fx(rows_program)(*args)
        solution = passes.solve_placements(gm, LINE, cost_model=SLOW_LINK)
        passes.apply_placements(gm, solution)
        passes.check_placements(gm)
        self.assertExpectedInline(readable(gm), """\
class rows_program(torch.nn.Module):
    def forward(self, x_1: "f32[64, 32]", w_1: "f32[32, 16]"):
        hops_sharding_annotation_2 = torch.ops.higher_order.hops_sharding_annotation(w_1, hops.ShardingSpec(hops.Mesh.of(data=2), 'R'))
        hops_sharding_annotation_1 = torch.ops.higher_order.hops_sharding_annotation(x_1, hops.ShardingSpec(hops.Mesh.of(data=2), 'S(0)'))
        hops_sharding_annotation: "f32[64, 32]" = torch.ops.higher_order.hops_sharding_annotation(hops_sharding_annotation_1, hops.ShardingSpec(hops.Mesh.of(data=2), 'S(0)'))
        mm: "f32[64, 16]" = torch.ops.aten.mm.default(hops_sharding_annotation, hops_sharding_annotation_2)
        hops_sharding_annotation_3 = torch.ops.higher_order.hops_sharding_annotation(mm, hops.ShardingSpec(hops.Mesh.of(data=2), 'S(0)'))
        relu: "f32[64, 16]" = torch.ops.aten.relu.default(hops_sharding_annotation_3)
        hops_sharding_annotation_4 = torch.ops.higher_order.hops_sharding_annotation(relu, hops.ShardingSpec(hops.Mesh.of(data=2), 'S(0)'))
        return hops_sharding_annotation_4
""")
        self.assertEqual(gm(*args), rows_program(*args))

    def test_a_read_in_another_layout_is_stated_before_the_reader(self):
        args = (torch.randn(64, 32), torch.randn(32, 16))
        gm = make_fx(contracted_program)(*args)
        solution = passes.solve_placements(gm, LINE, cost_model=SLOW_LINK)
        # The contraction leaves a pending sum: not stated (no XLA sharding says "partial").
        self.assertEqual(solution.strategies["mm"].outputs, ((hops.Partial(),),))
        relu_reads = solution.strategies["relu"].inputs[0]
        passes.apply_placements(gm, solution)
        passes.check_placements(gm)
        mm = next(n for n in gm.graph.nodes if n.name == "mm")
        (reader,) = mm.users
        self.assertIs(reader.target, hops.sharding_annotation_hop)
        self.assertEqual(reader.args[1].placements, relu_reads)
        self.assertEqual([u.target for u in reader.users], [torch.ops.aten.relu.default])
        self.assertEqual(gm(*args), contracted_program(*args))

    def test_a_scan_body_is_annotated_once_inside_the_body(self):
        def step(h, w):
            h = torch.tanh(h @ w)
            return h, h.sum(-1)

        def scanned(h, ws):
            last, ys = hops.scan(step, h, ws)
            return last.sum() + ys.sum()

        args = (torch.randn(8, 16), torch.randn(3, 16, 16, requires_grad=True))
        forward, backward, _ = aot_trace(scanned, *args)
        solution = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK)
        passes.apply_placements((forward, backward), solution)
        passes.check_placements(forward)
        passes.check_placements(backward)
        body = forward.get_submodule("step_body_0")
        stated = set(annotations(body))
        placed = {
            (key.split("/")[-1], placements) for key, placements in solution.placements.items()
            if key.startswith("forward/step_body_0/") and not any(isinstance(p, hops.Partial) for p in placements)
        }
        self.assertTrue(placed)
        self.assertLessEqual(placed, stated)
        # Once, not per step: the forward root graph has no copy of the body's ops.
        self.assertFalse([n for n in forward.graph.nodes if n.target is torch.ops.aten.tanh.default])
        outputs = forward(*(a.detach() for a in args))
        self.assertEqual(outputs[0], scanned(*args))

    def test_a_solution_applies_only_to_its_program(self):
        gm = make_fx(rows_program)(torch.randn(64, 32), torch.randn(32, 16))
        other = make_fx(rows_program)(torch.randn(64, 32), torch.randn(32, 16))
        solution = passes.solve_placements(gm, LINE, cost_model=SLOW_LINK)
        with self.assertRaisesRegex(passes.PassError, "not the program this solution was solved for"):
            passes.apply_placements(other, solution)
        with self.assertRaisesRegex(TypeError, "solution=...\\) must be a PlacementSolution, got dict"):
            passes.apply_placements(gm, {})


class TestFormatAndDraw(TestCase):
    def test_the_annotated_printout(self):
        gm = make_fx(contracted_program)(torch.randn(64, 32), torch.randn(32, 16))
        solution = passes.solve_placements(gm, LINE, cost_model=SLOW_LINK)
        self.assertExpectedInline(passes.format_placements(gm, solution), """\
# mesh {'data': 2}, cost 58.3us per step (cost model custom), peak 0.01074 MiB per device
x_1 = input()  # placement=S(1)
w_1 = input()  # placement=S(0)
hops_sharding_annotation = hops_sharding_annotation(x_1, ShardingSpec(S(1)))  # placement=(S(1)) -> S(1)
hops_sharding_annotation_1 = hops_sharding_annotation(w_1, ShardingSpec(S(0)))  # placement=(S(0)) -> S(0)
mm = aten.mm(hops_sharding_annotation, hops_sharding_annotation_1)  # placement=(S(1), S(0)) -> P, cost=[compute 32.8us, redistribute 0us]
relu = aten.relu(mm)  # placement=(S(0)) -> S(0), cost=[compute 4.1us, redistribute 21.5us]
return relu
""")

    def test_a_scan_body_is_printed_once_with_its_trip_count(self):
        def step(h, w):
            return torch.tanh(h @ w), None

        gm = make_fx(lambda h, ws: hops.scan(step, h, ws)[0])(torch.randn(8, 16), torch.randn(5, 16, 16))
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        text = passes.format_placements(gm, solution)
        self.assertEqual(text.count("aten.mm("), 1)
        self.assertIn("# body step_body_0, once for 5 steps", text)

    def test_draw_writes_png_and_svg(self):
        import os
        import tempfile

        pytest.importorskip("matplotlib")
        gm = make_fx(contracted_program)(torch.randn(64, 32), torch.randn(32, 16))
        solution = passes.solve_placements(gm, LINE, cost_model=SLOW_LINK)
        with tempfile.TemporaryDirectory() as directory:
            png = passes.draw_placements(gm, solution, os.path.join(directory, "plan.png"))
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            svg = passes.draw_placements(gm, solution, os.path.join(directory, "plan.svg"))
            with open(svg) as f:
                text = f.read()
            # The legend names each placement; one redistribution (the pending sum into relu).
            for label in ("S(0)", "S(1)", "redistribution"):
                self.assertIn(label, text)
            self.assertIn("1 redistributions", text)
            with self.assertRaisesRegex(ValueError, "must end in .png or .svg, got '.*plan.pdf'"):
                passes.draw_placements(gm, solution, os.path.join(directory, "plan.pdf"))


# --------------------------------------------------------------------------- on XLA


def xla_device():
    import torch_xla

    return torch_xla.device()


def sync():
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def xla_sharding_of(spec, shape):
    """The sharding torch_xla's own mark_sharding attaches for ``spec`` on a tensor of ``shape``."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    t = torch.zeros(shape, device=xla_device()) + 1
    xs.mark_sharding(t, spec.mesh.to_xla(), spec.to_partition_spec(len(shape)))
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def block(h, w):
    h = h + torch.tanh(h @ w)
    return h, h.square().mean()


attention = hops.local_map(
    lambda q, k: (q @ k.transpose(-1, -2)).softmax(-1) @ k,
    mesh=GRID,
    in_placements=((S0, R), (S0, R)),
    out_placements=(S0, R),
)


def model(x, w_in, ws, w_out):
    h = attention(x @ w_in, x)
    h, per_layer = hops.scan(block, h, ws)
    return (h @ w_out).square().mean() + per_layer.sum()


@pytest.mark.xla
def test_the_applied_solution_runs_on_4_xla_devices_like_eager_with_the_chosen_shardings():
    torch.manual_seed(0)
    args = [
        torch.randn(4, 8, 16),
        torch.randn(16, 16, requires_grad=True),
        (torch.randn(3, 16, 16) / 4).requires_grad_(),
        torch.randn(16, 8, requires_grad=True),
    ]
    forward, backward, _ = aot_trace(model, *args)
    solution = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK)
    passes.apply_placements((forward, backward), solution)
    passes.check_placements(forward)
    passes.check_placements(backward)
    passes.lower_to_xla(forward)
    passes.lower_to_xla(backward)

    device = xla_device()
    loss, *saved = forward(*(a.detach().to(device) for a in args))
    forward_hlo = hlo_text(loss, *saved)
    sync()
    grads = backward(*saved, torch.ones((), device=device))
    backward_hlo = hlo_text(*(g for g in grads if g is not None))
    sync()

    reference = model(*args)
    expected = torch.autograd.grad(reference, args[1:])
    torch.testing.assert_close(loss.cpu(), reference.detach(), rtol=1e-4, atol=1e-5)
    for grad, want in zip(grads[1:], expected):
        torch.testing.assert_close(grad.cpu(), want, rtol=1e-4, atol=1e-5)

    # Every sharded placement the solver chose for a forward value is a Sharding custom call.
    stated = set(re.findall(r'custom_call_target="Sharding", sharding=(\{[^}]*\})', forward_hlo))
    chosen = {
        (placements, solution.graph.nodes[key]["shape"])
        for key, placements in solution.placements.items()
        if key.startswith("forward/") and not all(p == R for p in placements)
        and not any(isinstance(p, hops.Partial) for p in placements)
    }
    assert chosen
    for placements, shape in chosen:
        assert xla_sharding_of(ShardingSpec(GRID, placements), shape) in stated, (placements, shape)
    # The scan is one While, the region a manual region, forward and backward.
    assert forward_hlo.count(" while(") == 1 and backward_hlo.count(" while(") == 1
    assert '"SPMDFullToShardShape"' in forward_hlo and '"SPMDFullToShardShape"' in backward_hlo



def test_pending_sums_states_the_reads_that_keep_a_pending_sum():
    # x split by rows and along the contracted dim makes the product a pending sum over
    # "model", laid out (S(0), P); the region reads it as (R, P): its rows gathered, the sum
    # kept. That read is stated with pending_sums=True (DTensor then gathers there, as the plan
    # prices); by default it is left to the target (an XLA sharding cannot state a pending sum).
    from hops import Partial

    pending = (R, Partial())
    region = hops.local_map(lambda y: y * 2, mesh=GRID, in_placements=(pending,), out_placements=pending)

    def program(x, w):
        y = hops.annotate_sharding(x, ShardingSpec(GRID, (S0, S1))) @ hops.annotate_sharding(w, ShardingSpec(GRID, (R, S0)))
        return region(y)

    def solved():
        gm = make_fx(program)(torch.randn(8, 256), torch.randn(256, 4))
        return gm, passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)

    gm, solution = solved()
    assert solution.placements["mm"] == (S0, Partial())  # the premise: the product keeps its sum
    passes.apply_placements(gm, solution)
    assert [placements for _, placements in annotations(gm) if Partial() in placements] == []

    gm, solution = solved()
    passes.apply_placements(gm, solution, pending_sums=True)
    assert [(value, placements) for value, placements in annotations(gm) if Partial() in placements] == [("mm", pending)]


# A region's (input, output) placement on one mesh axis: elementwise it keeps a layout, and
# scaling a replicated value is a valid pending sum (each device's part adds up to the result).
AXIS_LAYOUTS = [(R, R), (S0, S0), (S1, S1), (R, hops.Partial()), (hops.Partial(), hops.Partial())]
LAYOUTS = [(a, b) for a in (R, S0, S1) for b in (R, S0, S1)]


PROGRAMS = dict(
    axes=st.tuples(st.sampled_from(AXIS_LAYOUTS), st.sampled_from(AXIS_LAYOUTS)),
    then=st.none() | st.tuples(st.sampled_from(AXIS_LAYOUTS), st.sampled_from(AXIS_LAYOUTS)),
    entering=st.sampled_from(LAYOUTS),
    leaving=st.sampled_from(LAYOUTS),
    matmul=st.booleans(),
    slow_link=st.booleans(),
)


def scaling_region(axes, scale):
    return hops.local_map(
        lambda a: a * scale, mesh=GRID, in_placements=(tuple(a for a, _ in axes),), out_placements=tuple(b for _, b in axes)
    )


def applied(axes, then, entering, leaving, matmul, slow_link, pending_sums):
    """A region whose output may be a pending sum (read by a second region if ``then``) between
    annotations, trained, solved and applied: (forward, backward, forward's inputs, forward's
    outputs before apply)."""
    region = scaling_region(axes, 2)
    second = scaling_region(then, 3) if then is not None else (lambda a: a)

    def program(x, w):
        y = second(region(hops.annotate_sharding(x, ShardingSpec(GRID, entering)))).relu()
        return hops.annotate_sharding(y @ w if matmul else y, ShardingSpec(GRID, leaving))

    torch.manual_seed(0)
    args = [torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)]
    forward, backward, _ = aot_trace(program, *args)
    inputs = [a.detach() for a in args]
    before = forward(*inputs)
    solution = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK if slow_link else FAST_LINK)
    passes.apply_placements((forward, backward), solution, pending_sums=pending_sums)
    return forward, backward, inputs, before


@settings(max_examples=40, deadline=None)
@given(pending_sums=st.booleans(), **PROGRAMS)
def test_any_applied_solution_passes_check_placements_and_keeps_the_values(pending_sums, **program):
    # The contract of apply_placements, for every way a region's pending sums can be read and
    # written: check_placements passes afterwards (forward and backward) and the program
    # computes what it computed before.
    forward, backward, inputs, before = applied(pending_sums=pending_sums, **program)
    passes.check_placements(forward)
    passes.check_placements(backward)
    for got, want in zip(forward(*inputs), before):
        torch.testing.assert_close(got, want)


@pytest.mark.xla
@settings(max_examples=8, deadline=None)
@given(**PROGRAMS)
def test_any_applied_solution_lowers_to_xla_and_runs_like_eager(**program):
    forward, _, inputs, before = applied(pending_sums=False, **program)
    passes.lower_to_xla(forward)
    device = xla_device()
    outputs = forward(*(x.to(device) for x in inputs))
    sync()
    for got, want in zip(outputs, before):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
