"""Region alternatives with other local shapes: row- vs column-parallel ``x @ w``.

``hops.local_map(..., alternatives=[...])`` offers a solver several placements of one region;
an alternative may give the body other local shapes than the first. The traced node then
carries one body per alternative (each traced on its own local shapes), eager and every
lowering run the active one, the solver prices each with its own body, ``apply_placements``
switches to the cheapest, and the backward region takes the same alternative as the forward.
"""

import copy
import io
import pickle

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import LocalMapSpec, Mesh, RegionPlacements, Replicate, Shard
from passes.solver import CostModel
from passes.solver.graph import NodeKind
from passes.solver.solve import evaluate_placements
from tests.helpers.snapshot import TestCase, aot_trace, compile_trace, hlo_text, readable

LINE = Mesh.of(model=4)
R, S0, S1 = Replicate(), Shard(0), Shard(1)
# Memory-bound (FLOPs are nearly free): a body costs the bytes it moves on its local shapes.
MEMORY_BOUND = CostModel(peak_flops=1e18, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6)

ROW_PARALLEL = RegionPlacements("S(0), R", "S(0)")  # each device: a block of x's rows, all of w
COLUMN_PARALLEL = RegionPlacements("R, S(1)", "S(1)")  # each device: all of x, a block of w's columns


def project(x, w):
    return x @ w


def projection(body=project, alternatives=(COLUMN_PARALLEL,)):
    """``body`` as a region: row-parallel (its main placements) or column-parallel (or the
    ``alternatives`` given)."""
    return hops.local_map(body, mesh=LINE, in_placements=((S0,), (R,)), out_placements=((S0,),), alternatives=list(alternatives))


def region_nodes(gm):
    return [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.target is hops.local_map_hop]


def choose(gm, index):
    """Make every region of ``gm`` run its alternative ``index`` (as ``apply_placements`` does)."""
    for node in region_nodes(gm):
        node.args = (*node.args[:-1], node.args[-1].choose(index))
    gm.recompile()


def mm_seconds(cost_model, x_shape, w_shape):
    """What a body ``x @ w`` costs on these local shapes, by the cost model's own roofline."""
    out = (x_shape[0], w_shape[1])
    return cost_model.compute_seconds(torch.ops.aten.mm.default, [x_shape, w_shape], [out], 4)


class TestTracedBodies(TestCase):
    def test_the_node_carries_one_body_per_alternative_each_on_its_own_local_shapes(self):
        gm = make_fx(projection(), tracing_mode="fake")(torch.randn(8, 6), torch.randn(6, 12))
        self.assertExpectedInline(readable(gm), """\
class project(torch.nn.Module):
    def forward(self, x_1: "f32[8, 6]", w_1: "f32[6, 12]"):
        project_alternative0_body_0 = self.project_alternative0_body_0
        project_alternative1_body_0 = self.project_alternative1_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map((project_alternative0_body_0, project_alternative1_body_0), x_1, w_1, hops.LocalMapSpec(hops.Mesh.of(model=4), 'S(0), R', 'S(0)', alternatives=(hops.RegionPlacements('S(0), R', 'S(0)'), hops.RegionPlacements('R, S(1)', 'S(1)'))))
        getitem: "f32[8, 12]" = hops_local_map[0]
        return getitem
    class project_alternative0_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 6]", arg1_1: "f32[6, 12]"):
            mm: "f32[2, 12]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            return (mm,)
    class project_alternative1_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[8, 6]", arg1_1: "f32[6, 3]"):
            mm: "f32[8, 3]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            return (mm,)
""")

    def test_eager_and_traced_run_the_active_alternative_and_each_gives_the_product(self):
        x, w = torch.randn(8, 6), torch.randn(6, 12)
        region = projection()
        self.assertEqual(region(x, w), x @ w)
        gm = make_fx(region)(x, w)
        for index in (0, 1, 0):
            choose(gm, index)
            self.assertEqual(gm(x, w), x @ w)
            lowered = passes.inline_hops(copy.deepcopy(gm))
            self.assertEqual(lowered(x, w), x @ w)
            self.assertEqual([n for n in lowered.graph.nodes if n.target is hops.local_map_hop], [])

    def test_the_active_alternative_is_what_runs(self):
        # A body that is not the same function on every layout (it adds each device's row
        # count) tells which alternative ran: 2 rows per device row-parallel, 8 column-parallel.
        def offset(x, w):
            return x @ w + x.shape[0]

        x, w = torch.randn(8, 6), torch.randn(6, 12)
        gm = make_fx(projection(offset))(x, w)
        self.assertEqual(gm(x, w), x @ w + 2)
        choose(gm, 1)
        self.assertEqual(gm(x, w), x @ w + 8)
        self.assertEqual(passes.inline_hops(gm)(x, w), x @ w + 8)

    def test_round_trips_keep_every_alternative(self):
        x, w = torch.randn(8, 6), torch.randn(6, 12)

        class Program(torch.nn.Module):
            def forward(self, x, w):
                return projection()(x, w)

        exported = torch.export.export(Program(), (x, w))
        buffer = io.BytesIO()
        torch.export.save(exported, buffer)
        buffer.seek(0)
        loaded = torch.export.load(buffer)
        gm = make_fx(projection())(x, w)
        for copied in (loaded.graph_module, pickle.loads(pickle.dumps(gm)), copy.deepcopy(gm)):
            (node,) = region_nodes(copied)
            bodies = node.args[0]
            self.assertEqual(len(bodies), 2)
            self.assertEqual(node.args[-1], region_nodes(gm)[0].args[-1])
            # Each body still computes on its own alternative's local shapes.
            row_body, column_body = (copied.get_submodule(b.target) for b in bodies)
            self.assertEqual(row_body(x[:2], w), (x[:2] @ w,))
            self.assertEqual(column_body(x, w[:, :3]), (x @ w[:, :3],))
        self.assertEqual(loaded.module()(x, w), x @ w)
        unpickled = pickle.loads(pickle.dumps(gm))
        choose(unpickled, 1)
        self.assertEqual(unpickled(x, w), x @ w)

    def test_inconsistent_alternatives_are_refused(self):
        x, w = torch.randn(8, 6), torch.randn(6, 12)
        cases = [
            # Wrong number of placements: checked before anything is traced.
            (RegionPlacements("R", "S(1)"), LocalMapSpec, r"alternative 1\): in_placements length 1 does not match"),
            (RegionPlacements("R, S(1)", "S(1), S(1)"), LocalMapSpec, r"alternative 1's out_placements describe other outputs"),
            # A split that is not even for the input it splits (x's 6 columns over 4 devices).
            (RegionPlacements("S(1), R", "S(0)"), ValueError, r"args\[0\] \(alternative 1\): dim 1 has size 6.*4 ways"),
            # The body fails on the alternative's local shapes: x's 8 columns meet w's 2 rows.
            (RegionPlacements("R, S(0)", "P"), ValueError, r"alternative 1 .*body fails on that alternative's local shapes"),
            # Another global output: S(0) of an (8, 3) block makes (32, 3), not (8, 12).
            (RegionPlacements("R, S(1)", "S(0)"), ValueError, r"output\[0\]: alternative 1 .*\(32, 3\).*\(8, 12\)"),
        ]
        for alternative, error, message in cases:
            error = ValueError if error is LocalMapSpec else error  # torch's class: AssertionError and ValueError
            inputs = (torch.randn(8, 8), torch.randn(8, 12)) if "body fails" in message else (x, w)
            for run in (lambda f, *a: f(*a), lambda f, *a: make_fx(f)(*a), lambda f, *a: make_fx(f, tracing_mode="fake")(*a)):
                with self.subTest(alternative=alternative), self.assertRaisesRegex(error, message):
                    region = hops.local_map(
                        project, mesh=LINE, in_placements=((S0,), (R,)), out_placements=((S0,),), alternatives=[alternative]
                    )
                    run(region, *inputs)

    def test_a_node_whose_bodies_do_not_match_its_alternatives_is_refused_by_the_passes(self):
        gm = make_fx(projection())(torch.randn(8, 6), torch.randn(6, 12))
        (node,) = region_nodes(gm)
        node.args = (node.args[0][0], *node.args[1:])  # one body for two alternatives
        gm.recompile()
        with self.assertRaisesRegex(passes.PassError, r"1 bodies for a spec with 2 options"):
            passes.inline_hops(gm)


class TestDynamo(TestCase):
    """Under ``torch.compile`` the node carries one body per alternative, as under make_fx:
    Dynamo speculates the body once per alternative, on that alternative's local shapes."""

    def test_dynamo_traces_one_body_per_alternative_each_on_its_own_local_shapes(self):
        # Shapes are constants of a Dynamo graph: the row count added is 2 row-parallel, 8
        # column-parallel, so each body is only right for its own alternative.
        def offset(x, w):
            return x @ w + x.shape[0]

        x, w = torch.randn(8, 6), torch.randn(6, 12)
        graphs = []
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w: projection(offset)(x, w), backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)
        self.assertEqual(compiled(x, w), x @ w + 2)
        (gm,) = graphs
        self.assertExpectedInline(readable(gm), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[8, 6]", L_w_: "f32[6, 12]"):
        l_x_ = L_x_
        l_w_ = L_w_
        offset_alternative0_body_0 = self.offset_alternative0_body_0
        offset_alternative1_body_0 = self.offset_alternative1_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map((offset_alternative0_body_0, offset_alternative1_body_0), l_x_, l_w_, (), hops.LocalMapSpec(hops.Mesh.of(model=4), 'S(0), R', 'S(0)', alternatives=(hops.RegionPlacements('S(0), R', 'S(0)'), hops.RegionPlacements('R, S(1)', 'S(1)'))))
        outputs: "f32[8, 12]" = hops_local_map[0]
        return (outputs,)
    class offset_alternative0_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[2, 6]", l_w_: "f32[6, 12]"):
            matmul: "f32[2, 12]" = l_x_ @ l_w_
            result: "f32[2, 12]" = matmul + 2
            return (result,)
    class offset_alternative1_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[8, 6]", l_w_: "f32[6, 3]"):
            matmul: "f32[8, 3]" = l_x_ @ l_w_
            result: "f32[8, 3]" = matmul + 8
            return (result,)
""")
        # The captured graph runs whichever alternative is chosen.
        for index, rows in ((1, 8), (0, 2)):
            choose(gm, index)
            self.assertEqual(gm(x, w)[0], x @ w + rows)

    def test_alternatives_closing_over_different_tensors_share_one_lifted_tuple(self):
        # Only the column-parallel body (8 local rows) reads ``bias`` and only the row-parallel
        # one reads ``scale``: every body takes both, in one order.
        bias, scale = torch.randn(12), torch.randn(())

        def shifted(x, w):
            return x @ w + bias[: w.shape[1]] if x.shape[0] == 8 else (x @ w) * scale

        x, w = torch.randn(8, 6), torch.randn(6, 12)
        region = projection(shifted)
        expected = [(x @ w) * scale, torch.cat([x @ w[:, 3 * d : 3 * d + 3] + bias[:3] for d in range(4)], dim=1)]
        for index in (0, 1):
            graphs = []

            def run_alternative(gm, _, index=index):
                graphs.append(gm)
                choose(gm, index)
                return gm

            torch._dynamo.reset()
            self.assertEqual(torch.compile(lambda x, w: region(x, w), backend=run_alternative, fullgraph=True)(x, w), expected[index])
            (node,) = region_nodes(graphs[0])
            self.assertEqual(len(node.args[3]), 2)
            for body in node.args[0]:
                self.assertEqual(len(graphs[0].get_submodule(body.target).graph.find_nodes(op="placeholder")), 4)

    def test_compiled_forward_and_backward_run_the_chosen_alternative_with_eager_gradients(self):
        def tanh_project(x, w):
            return (x @ w).tanh() * x.shape[0]

        x, w = torch.randn(8, 6, requires_grad=True), torch.randn(6, 12, requires_grad=True)
        torch._dynamo.reset()
        graphs, out = compile_trace(lambda x, w: projection(tanh_project)(x, w), x, w)
        self.assertEqual(out, (x @ w).tanh() * 2)
        self.assertEqual([len(n.args[0]) for g in ("dynamo", "forward", "backward") for n in region_nodes(graphs[g])], [2, 2, 2])
        forward, backward = graphs["forward"], graphs["backward"]
        for index, rows in ((1, 8), (0, 2)):
            expected = (x @ w).tanh() * rows
            cotangent = torch.randn(8, 12)
            expected_grads = torch.autograd.grad(expected, (x, w), cotangent)
            choose(forward, index)
            choose(backward, index)
            result, *saved = forward(x.detach(), w.detach())
            self.assertEqual(result, expected.detach())
            self.assertEqual(tuple(backward(*saved, cotangent)), expected_grads)

    def test_a_body_failing_on_an_alternative_raises_what_eager_raises(self):
        def reshaped(x, w):
            return x @ w.reshape(6, 12)  # w is (6, 3) column-parallel

        region = projection(reshaped)
        x, w = torch.randn(8, 6), torch.randn(6, 12)
        message = r"alternative 1 .*the body fails on that alternative's local shapes: RuntimeError: shape '\[6, 12\]' is invalid"
        with self.assertRaisesRegex(ValueError, message):
            region(x, w)
        torch._dynamo.reset()
        # Under fullgraph, Dynamo's Unsupported names it and carries it as its cause.
        with self.assertRaisesRegex(torch._dynamo.exc.Unsupported, message) as compiled:
            torch.compile(lambda x, w: region(x, w), backend="aot_eager", fullgraph=True)(x, w)
        self.assertIsInstance(compiled.exception.__cause__, ValueError)
        self.assertRegex(str(compiled.exception.__cause__), message)

    def test_an_op_failing_on_an_alternative_raises_its_own_exception_as_eager_does(self):
        # Dynamo keeps the op's exception in its error's chain, not in its text: the class
        # (not a builtin) and the message (quotes, a line break) reach the user unchanged.
        region = projection(lambda x, w: columns_checked_mm(x, w), alternatives=(RegionPlacements("R, S(0)", "P"),))
        x, w = torch.randn(8, 8), torch.randn(8, 12)
        with self.assertRaises(ValueError) as eager:
            region(x, w)
        self.assertIn("ColumnsError: x has 8 \"columns\",\nw has 2 'rows'", str(eager.exception))
        torch._dynamo.reset()
        with self.assertRaises(torch._dynamo.exc.Unsupported) as compiled:
            torch.compile(lambda x, w: region(x, w), backend="aot_eager", fullgraph=True)(x, w)
        self.assertIsInstance(compiled.exception.__cause__, ValueError)
        self.assertEqual(str(compiled.exception.__cause__), str(eager.exception))


class ColumnsError(Exception):
    pass


@torch.library.custom_op("hops_tests_alternatives::columns_checked_mm", mutates_args=())
def columns_checked_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@columns_checked_mm.register_fake
def _(x, w):
    if x.shape[1] != w.shape[0]:
        raise ColumnsError(f"x has {x.shape[1]} \"columns\",\nw has {w.shape[0]} 'rows'")
    return x.new_empty(x.shape[0], w.shape[1])


class TestAutograd(TestCase):
    def test_forward_and_backward_regions_carry_the_same_alternatives_and_agree_on_the_choice(self):
        def tanh_project(x, w):
            return (x @ w).tanh()

        x, w = torch.randn(8, 6, requires_grad=True), torch.randn(6, 12, requires_grad=True)
        expected = torch.autograd.grad(tanh_project(x, w).sum(), (x, w))
        forward, backward, _ = aot_trace(lambda x, w: projection(tanh_project)(x, w), x, w)
        (forward_node,), (backward_node,) = region_nodes(forward), region_nodes(backward)
        forward_spec, backward_spec = forward_node.args[-1], backward_node.args[-1]
        self.assertEqual((len(forward_node.args[0]), len(backward_node.args[0])), (2, 2))
        self.assertEqual((forward_spec.active, backward_spec.active), (0, 0))
        # The residual tanh(x @ w) is (2, 12) row-parallel, (8, 3) column-parallel: packed.
        self.assertEqual(forward_spec.residuals, 1)
        self.assertEqual(hops.spec_from_text(repr(forward_spec)), forward_spec)
        self.assertEqual(forward_spec.choose(1).residuals, 1)
        with self.assertRaisesRegex(ValueError, r"residuals=.*marks the residuals of a region with alternatives"):
            LocalMapSpec(LINE, "S(0)", "S(0), S(0)", residuals=1)
        self.assertExpectedInline(repr(backward_spec), """\
hops.LocalMapSpec(hops.Mesh.of(model=4), 'S(0), R, S(0), S(0)', 'S(0), P', alternatives=(hops.RegionPlacements('S(0), R, S(0), S(0)', 'S(0), P'), hops.RegionPlacements('R, S(1), S(0), S(1)', 'P, S(1)')))""")
        for index in (0, 1):
            choose(forward, index)
            choose(backward, index)
            out = forward(x.detach(), w.detach())
            self.assertEqual(out[0], tanh_project(x, w).detach())
            self.assertEqual(tuple(backward(*out[1:], torch.ones(8, 12))), expected)

    def test_gradients_of_every_alternative_match_gradcheck(self):
        x = torch.randn(8, 6, dtype=torch.double, requires_grad=True)
        w = torch.randn(6, 12, dtype=torch.double, requires_grad=True)
        region = projection(lambda x, w: (x @ w).sin())
        gm = make_fx(region)(x.detach(), w.detach())
        for index in (0, 1):
            choose(gm, index)
            torch.autograd.gradcheck(lambda x, w: gm(x, w), (x, w))
        torch.autograd.gradcheck(region, (x, w))


# --------------------------------------------------------------------------- the solver


def solved(x_shape, w_shape):
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    gm = make_fx(projection())(x, w)
    return gm, passes.solve_placements(gm, LINE, cost_model=MEMORY_BOUND), x, w


class TestSolver(TestCase):
    def test_the_solver_prices_each_alternative_with_its_own_body_and_picks_the_cheaper(self):
        # Many rows, a small w: splitting x's rows moves less; few rows, a wide w: splitting w does.
        for x_shape, w_shape in (((256, 64), (64, 16)), ((8, 64), (64, 1024))):
            with self.subTest(x=x_shape, w=w_shape):
                gm, solution, x, w = solved(x_shape, w_shape)
                rows = mm_seconds(MEMORY_BOUND, (x_shape[0] // 4, x_shape[1]), w_shape)
                columns = mm_seconds(MEMORY_BOUND, x_shape, (w_shape[0], w_shape[1] // 4))
                self.assertNotEqual(rows, columns)
                cheaper = 0 if rows < columns else 1
                self.assertEqual(solution.region_choice("hops_local_map"), cheaper)
                self.assertAlmostEqual(solution.cost, min(rows, columns), delta=1e-12)
                passes.apply_placements(gm, solution)
                (node,) = region_nodes(gm)
                self.assertEqual(node.args[-1].active, cheaper)
                passes.check_placements(gm)
                self.assertEqual(gm(x, w), x @ w)
                self.assertEqual(passes.inline_hops(gm)(x, w), x @ w)
        self.assertEqual([solved(*s)[1].region_choice("hops_local_map") for s in (((256, 64), (64, 16)), ((8, 64), (64, 1024)))], [0, 1])

    def test_printed_plan_names_every_alternative_body(self):
        gm, solution, _, _ = solved((8, 64), (64, 1024))
        text = passes.format_placements(gm, solution)
        self.assertIn("alternative 1 of 2", text)
        self.assertIn("# body project_alternative0_body_0 (alternative 0): 1 ops", text)
        self.assertIn("# body project_alternative1_body_0 (alternative 1): 1 ops", text)

    def test_forward_and_backward_regions_are_chosen_together(self):
        def tanh_project(x, w):
            return (x @ w).tanh()

        x, w = torch.randn(8, 64, requires_grad=True), torch.randn(64, 1024, requires_grad=True)
        forward, backward, _ = aot_trace(lambda x, w: projection(tanh_project)(x, w), x, w)
        solution = passes.solve_placements((forward, backward), LINE, cost_model=MEMORY_BOUND)
        regions = [k for k, d in solution.graph.nodes(data=True) if d["kind"] is NodeKind.REGION]
        self.assertEqual(len(regions), 2)
        choices = [solution.region_choice(k) for k in regions]
        self.assertEqual(choices[0], choices[1])
        # A plan running the forward of one alternative and the backward of the other is infeasible.
        mixed = dict(solution.strategies)
        for k, region in enumerate(regions):
            strategies = solution.graph.nodes[region]["strategies"]
            mixed[region] = strategies[(choices[0] + k) % 2]
        self.assertEqual(evaluate_placements(solution.graph, mixed, MEMORY_BOUND), float("inf"))
        passes.apply_placements((forward, backward), solution)
        self.assertEqual([region_nodes(g)[0].args[-1].active for g in (forward, backward)], choices)
        expected = torch.autograd.grad(tanh_project(x, w).sum(), (x, w))
        out = forward(x.detach(), w.detach())
        self.assertEqual(tuple(backward(*out[1:], torch.ones(8, 1024))), expected)


    def test_a_partial_alternative_pays_for_its_reduction(self):
        # Splitting the contraction dim moves the least, but leaves a pending sum that is
        # all-reduced before the result leaves the program: worth it on a fast link only.
        x, w = torch.randn(8, 4096), torch.randn(4096, 8)
        contraction = RegionPlacements("S(1), S(0)", "P")
        for link_bandwidth, chosen in ((1e8, 2), (1e3, 0)):
            with self.subTest(link_bandwidth=link_bandwidth):
                model = CostModel(peak_flops=1e18, memory_bandwidth=1e9, link_bandwidth=link_bandwidth, link_latency=1e-6)
                gm = make_fx(projection(alternatives=[COLUMN_PARALLEL, contraction]))(x, w)
                solution = passes.solve_placements(gm, LINE, cost_model=model)
                reduction = model.redistribute_seconds((8, 8), 4, (hops.Partial(),), (R,), LINE)
                costs = [
                    mm_seconds(model, (2, 4096), (4096, 8)),
                    mm_seconds(model, (8, 4096), (4096, 2)),
                    mm_seconds(model, (8, 1024), (1024, 8)) + reduction,
                ]
                self.assertEqual(solution.region_choice("hops_local_map"), chosen)
                self.assertEqual(min(range(3), key=costs.__getitem__), chosen)
                self.assertAlmostEqual(solution.cost, costs[chosen], delta=1e-12)
                self.assertEqual(solution.collectives(), {"all_reduce": 1} if chosen == 2 else {})
                passes.apply_placements(gm, solution)
                torch.testing.assert_close(passes.inline_hops(gm)(x, w), x @ w, atol=1e-3, rtol=1e-4)


MATMUL_LAYOUTS = {
    "rows": ("S(0), R", "S(0)"),
    "columns": ("R, S(1)", "S(1)"),
    "contraction": ("S(1), S(0)", "P"),  # a pending sum: only for a body linear in the product
    "replicated": ("R, R", "R"),
}


class TestProperties(TestCase):
    @settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        devices=st.sampled_from([2, 4]),
        options=st.lists(st.sampled_from(sorted(MATMUL_LAYOUTS)), min_size=2, max_size=3, unique=True),
        sizes=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
        seed=st.integers(0, 2**16),
    )
    def test_every_alternative_computes_the_product_and_its_gradients_forward_and_backward(self, devices, options, sizes, seed):
        linear = "contraction" in options
        body = (lambda x, w: (x @ w) * 3) if linear else (lambda x, w: torch.tanh(x @ w))
        main, *others = [MATMUL_LAYOUTS[o] for o in options]
        mesh = Mesh.of(model=devices)
        in_placements = tuple(hops.specs.parse_groups(main[0], "in"))
        region = hops.local_map(
            body, mesh=mesh, in_placements=in_placements, out_placements=hops.specs.parse_groups(main[1], "out"),
            alternatives=[RegionPlacements(*o) for o in others],
        )
        generator = torch.Generator().manual_seed(seed)
        m, k, n = (size * devices for size in sizes)
        x = torch.randn(m, k, generator=generator, dtype=torch.double, requires_grad=True)
        w = torch.randn(k, n, generator=generator, dtype=torch.double, requires_grad=True)
        cotangent = torch.randn(m, n, generator=generator, dtype=torch.double)
        expected = body(x, w)
        expected_grads = torch.autograd.grad(expected, (x, w), cotangent)
        self.assertEqual(region(x, w), expected)
        forward, backward, _ = aot_trace(region, x, w)
        self.assertEqual([len(n.args[0]) for g in (forward, backward) for n in region_nodes(g)], [len(options)] * 2)
        for index in range(len(options)):
            choose(forward, index)
            choose(backward, index)
            out, *saved = forward(x.detach(), w.detach())
            self.assertEqual(out, expected.detach())
            self.assertEqual(tuple(backward(*saved, cotangent)), expected_grads)


# --------------------------------------------------------------------------- XLA


@pytest.mark.xla
@pytest.mark.parametrize(
    "x_shape, w_shape, cheaper, local_product",
    [((256, 64), (64, 16), 0, "f32[64,16]"), ((8, 64), (64, 1024), 1, "f32[8,256]")],
    ids=["row-parallel", "column-parallel"],
)
def test_the_chosen_plan_runs_as_a_manual_region_on_four_xla_devices(x_shape, w_shape, cheaper, local_product):
    import torch_xla

    gm, solution, x, w = solved(x_shape, w_shape)
    assert solution.region_choice("hops_local_map") == cheaper
    passes.apply_placements(gm, solution)
    lowered = passes.lower_to_xla(gm)
    device = torch_xla.device()
    out = lowered(x.to(device), w.to(device))
    hlo = hlo_text(out)
    # The manual region computes the chosen body's product on each device's local shapes.
    assert f"{local_product}{{1,0}} dot(" in hlo, hlo
    torch.testing.assert_close(out.cpu(), x @ w)


@pytest.mark.xla
@pytest.mark.parametrize("index", [0, 1], ids=["row-parallel", "column-parallel"])
def test_forward_and_backward_of_the_chosen_alternative_lower_to_xla(index):
    import torch_xla

    def tanh_project(x, w):
        return torch.tanh(x @ w)

    x, w = torch.randn(8, 6), torch.randn(6, 12)
    forward, backward, _ = aot_trace(projection(tanh_project), x.clone().requires_grad_(), w.clone().requires_grad_())
    for gm in (forward, backward):
        choose(gm, index)
        passes.lower_to_xla(gm)
    device = torch_xla.device()
    out, *saved = forward(x.to(device), w.to(device))
    grads = backward(*saved, torch.ones(8, 12, device=device))
    leaves = (x.clone().requires_grad_(), w.clone().requires_grad_())
    expected = tanh_project(*leaves)
    torch.testing.assert_close(out.cpu(), expected.detach())
    torch.testing.assert_close([g.cpu() for g in grads], list(torch.autograd.grad(expected.sum(), leaves)))


@pytest.mark.xla
def test_eager_on_xla_devices_runs_the_active_alternative_with_its_gradients():
    import torch_xla

    def tanh_project(x, w):
        return torch.tanh(x @ w)

    device = torch_xla.device()
    x, w = torch.randn(8, 6), torch.randn(6, 12)
    on_xla = (x.to(device).requires_grad_(), w.to(device).requires_grad_())
    out = projection(tanh_project)(*on_xla)
    out.sum().backward()
    leaves = (x.clone().requires_grad_(), w.clone().requires_grad_())
    expected = tanh_project(*leaves)
    torch.testing.assert_close(out.cpu(), expected.detach())
    torch.testing.assert_close([t.grad.cpu() for t in on_xla], list(torch.autograd.grad(expected.sum(), leaves)))
