"""placement_graph: one node per value (HOP bodies included), strategies from DTensor's rules,
fixed placements from HOP args, a scan body once, forward and backward joined, meta-free."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec
from passes.solver.graph import NodeKind, Strategy, format_placement
from tests.helpers.snapshot import TestCase, aot_trace, delete_meta

LINE = Mesh((2,), ("data",))
GRID = Mesh((2, 2), ("data", "model"))
R, S0, S1 = Replicate(), Shard(0), Shard(1)


def summary(graph, keys=None):
    """One line per node: name, kind, op, shape, and for aliases what they alias."""
    lines = []
    for key, data in graph.nodes(data=True):
        if keys is not None and key not in keys:
            continue
        alias = "" if data["alias"] is None else f" = {data['alias'][0]}[{data['alias'][1]}]" + (
            f" shifted {data['alias'][2]}" if data["alias"][2] else ""
        )
        lines.append(f"{key}: {data['kind']} {data['op']} {list(data['shape']) if data['shape'] is not None else '-'} x{data['multiplier']}{alias}")
    return "\n".join(lines) + "\n"


def uses(graph, key):
    return sorted(
        (u, str(use.kind), use.index, use.multiplier) for u, _, data in graph.in_edges(key, data=True) for use in data["uses"]
    )


def matmul_relu(x, w):
    return (x @ w).relu()


class TestValuesAndStrategies(TestCase):
    def test_one_node_per_value_with_shapes_edges_and_dtensor_strategies(self):
        gm = make_fx(matmul_relu)(torch.randn(8, 4), torch.randn(4, 6))
        graph = passes.placement_graph(gm, LINE)
        self.assertExpectedInline(summary(graph), """\
x_1: input placeholder [8, 4] x1
w_1: input placeholder [4, 6] x1
mm: op aten.mm.default [8, 6] x1
relu: op aten.relu.default [8, 6] x1
output: output output - x1
""")
        self.assertEqual(
            sorted((u, v, d["bytes"]) for u, v, d in graph.edges(data=True)),
            [("mm", "relu", 8 * 6 * 4), ("relu", "output", 8 * 6 * 4), ("w_1", "mm", 4 * 6 * 4), ("x_1", "mm", 8 * 4 * 4)],
        )
        # An input may take any layout that splits evenly (no Partial).
        self.assertEqual([format_placement(s.outputs[0]) for s in graph.nodes["x_1"]["strategies"]], ["R", "S(0)", "S(1)"])
        # mm's strategies are DTensor's: row split, column split, contraction split (Partial), replicated.
        mm = set(graph.nodes["mm"]["strategies"])
        for strategy in (
            Strategy(((R,),), ((R,), (R,))),
            Strategy(((S0,),), ((S0,), (R,))),
            Strategy(((S1,),), ((R,), (S1,))),
            Strategy(((Partial(),),), ((S1,), (S0,))),
        ):
            self.assertIn(strategy, mm)
        # relu is not linear: no Partial output.
        self.assertTrue(all(not isinstance(s.outputs[0][0], Partial) for s in graph.nodes["relu"]["strategies"]))
        self.assertEqual(uses(graph, "mm"), [("w_1", "input", 1, 1), ("x_1", "input", 0, 1)])

    def test_uneven_splits_are_not_candidates(self):
        gm = make_fx(matmul_relu)(torch.randn(6, 3), torch.randn(3, 5))
        graph = passes.placement_graph(gm, GRID)
        # 6 rows split over one mesh axis of 2, not over both; 3 and 5 never split.
        self.assertEqual(
            [format_placement(s.outputs[0]) for s in graph.nodes["x_1"]["strategies"]], ["RR", "RS(0)", "S(0)R"]
        )
        for strategy in graph.nodes["relu"]["strategies"]:
            self.assertIn(format_placement(strategy.outputs[0]), ("RR", "RS(0)", "S(0)R"))

    def test_an_op_without_a_dtensor_rule_is_replicated_and_listed(self):
        @hops.kernel(abstract=lambda x: torch.empty_like(x))
        def opaque_double(x):
            return x * 2

        gm = make_fx(lambda x: opaque_double(x).sin())(torch.randn(4, 4))
        graph = passes.placement_graph(gm, GRID)
        node = next(k for k, d in graph.nodes(data=True) if d["op"] == "hops_kernel_opaque_double")
        self.assertTrue(graph.nodes[node]["fallback"])
        self.assertEqual(graph.nodes[node]["strategies"], [Strategy(((R, R),), ((R, R),))])
        self.assertEqual(graph.graph["unsupported_ops"], {"hops_kernel_opaque_double": 1})

    def test_an_einsum_kernel_gets_dtensor_einsum_strategies(self):
        gm = make_fx(lambda x, w: hops.einsum("bd,df->bf", x, w))(torch.randn(4, 8), torch.randn(8, 6))
        graph = passes.placement_graph(gm, LINE)
        einsum = next(d for _, d in graph.nodes(data=True) if d["op"] == "hops_kernel_einsum")
        self.assertFalse(einsum["fallback"])
        self.assertIn(Strategy(((Partial(),),), ((S1,), (S0,))), einsum["strategies"])
        self.assertIn(Strategy(((S0,),), ((S0,), (R,))), einsum["strategies"])

    def test_bad_arguments_are_refused(self):
        gm = make_fx(matmul_relu)(torch.randn(8, 4), torch.randn(4, 6))
        with self.assertRaisesRegex(TypeError, r"placement_graph\(mesh=...\) must be a hops.Mesh, got tuple"):
            passes.placement_graph(gm, (2, 2))
        with self.assertRaisesRegex(TypeError, "must be a torch.fx.GraphModule or a \\(forward, backward\\) pair"):
            passes.placement_graph(matmul_relu, LINE)


class TestFixedPlacements(TestCase):
    def test_an_annotation_fixes_its_value(self):
        rows = ShardingSpec(GRID, (S0, R))
        gm = make_fx(lambda x: hops.annotate_sharding(x.sin(), rows).cos())(torch.randn(4, 4))
        graph = passes.placement_graph(gm, GRID)
        data = graph.nodes["hops_sharding_annotation"]
        self.assertEqual((data["kind"], data["fixed"]), (NodeKind.ANNOTATION, True))
        self.assertEqual(data["strategies"], [Strategy(((S0, R),), ((S0, R),))])

    def test_an_annotation_on_another_mesh_is_refused(self):
        other = ShardingSpec(Mesh((4,), ("x",)), (S0,))
        gm = make_fx(lambda x: hops.annotate_sharding(x, other))(torch.randn(4, 4))
        with self.assertRaisesRegex(passes.PassError, "is placed on hops.Mesh.of\\(x=4\\).*one mesh per program"):
            passes.placement_graph(gm, GRID)

    def test_a_region_fixes_its_inputs_and_outputs_and_its_body_is_local(self):
        region = hops.local_map(lambda a, b: a * b, mesh=GRID, in_placements=((S0, R), (S0, R)), out_placements=(S0, R))
        gm = make_fx(lambda x, y: region(x.sin(), y).cos())(torch.randn(4, 4), torch.randn(4, 4))
        graph = passes.placement_graph(gm, GRID)
        self.assertEqual(graph.nodes["hops_local_map"]["strategies"], [Strategy(((S0, R),), ((S0, R), (S0, R)))])
        self.assertEqual(graph.nodes["getitem"]["alias"], ("hops_local_map", 0, 0))
        body = [k for k, d in graph.nodes(data=True) if d["kind"] is NodeKind.LOCAL]
        self.assertEqual(sorted(body), ["lambda_body_0/arg0_1", "lambda_body_0/arg1_1", "lambda_body_0/mul"])
        self.assertEqual(graph.nodes["lambda_body_0/mul"]["shape"], (2, 4))  # local shapes


def step(h, w):
    h = torch.tanh(h @ w)
    return h, h.sum(-1)


def scanned(h, ws):
    last, ys = hops.scan(step, h, ws)
    return last.sum() + ys.sum()


class TestScan(TestCase):
    def test_a_scan_body_appears_once_with_its_trip_count(self):
        graphs = {}
        for length in (3, 7):
            gm = make_fx(scanned)(torch.randn(4, 8), torch.randn(length, 8, 8))
            graphs[length] = passes.placement_graph(gm, GRID)
        self.assertEqual(graphs[3].number_of_nodes(), graphs[7].number_of_nodes())
        graph = graphs[7]
        self.assertExpectedInline(summary(graph), """\
h_1: input placeholder [4, 8] x1
ws_1: input placeholder [7, 8, 8] x1
step_body_0/arg0_1: input placeholder [4, 8] x7
step_body_0/arg1_1: input placeholder [8, 8] x7
step_body_0/mm: op aten.mm.default [4, 8] x7
step_body_0/tanh: op aten.tanh.default [4, 8] x7
step_body_0/sum_1: op aten.sum.dim_IntList [4] x7
step_body_0/output: output output - x7
getitem: alias getitem [4, 8] x1 = step_body_0/tanh[0]
getitem_1: alias getitem [7, 4] x1 = step_body_0/sum_1[0] shifted 1
sum_1: op aten.sum.default [] x1
sum_2: op aten.sum.default [] x1
add: op aten.add.Tensor [] x1
output: output output - x1
""")
        # The carry input has its own layout: the init is laid out like it once, before the
        # loop, and each later step's carry input is the step before's carry output, laid out
        # like it (6 times for 7 steps). The stacked weights are laid out once, before the
        # loop, like the body's slice with a leading dim (all the steps' bytes).
        self.assertEqual(
            uses(graph, "step_body_0/arg0_1"), [("h_1", "value", 0, 1), ("step_body_0/tanh", "carry", 0, 6)]
        )
        self.assertTrue(graph.edges["step_body_0/tanh", "step_body_0/arg0_1"]["loop"])
        self.assertEqual(uses(graph, "step_body_0/arg1_1"), [("ws_1", "value", 1, 1)])
        (slice_read,) = graph.edges["ws_1", "step_body_0/arg1_1"]["uses"]
        self.assertIsNone(slice_read.shape)
        # Reads inside the body happen at every step.
        self.assertEqual(uses(graph, "step_body_0/mm"), [("step_body_0/arg0_1", "input", 0, 7), ("step_body_0/arg1_1", "input", 1, 7)])
        # The final carry left its step whole; the stacked ys keep their steps' pending sums;
        # the body's output reads its carry (reduced at every step), not its ys.
        self.assertTrue(graph.nodes["getitem"]["whole"])
        self.assertFalse(graph.nodes["getitem_1"]["whole"])
        self.assertEqual(uses(graph, "step_body_0/output"), [("step_body_0/tanh", "output", 0, 7)])

    def test_a_stacked_input_is_not_split_along_the_scanned_dim(self):
        gm = make_fx(scanned)(torch.randn(4, 8), torch.randn(4, 8, 8))
        graph = passes.placement_graph(gm, GRID)
        for strategy in graph.nodes["ws_1"]["strategies"]:
            self.assertNotIn(Shard(0), strategy.outputs[0])


class TestForwardAndBackward(TestCase):
    def test_the_backward_reads_the_forward_saved_values_and_gradients_follow_parameters(self):
        x, w = torch.randn(8, 4), torch.randn(4, 6, requires_grad=True)
        forward, backward, _ = aot_trace(lambda x, w: (x @ w).relu(), x, w)
        graph = passes.placement_graph((forward, backward), LINE)
        # Saved values are the forward's values (aliases), tangents are free inputs.
        saved = [k for k, d in graph.nodes(data=True) if d["kind"] is NodeKind.ALIAS and k.startswith("backward/")]
        self.assertTrue(saved)
        for key in saved:
            self.assertTrue(graph.nodes[key]["alias"][0].startswith("forward/"))
        roles = {k: d["role"] for k, d in graph.nodes(data=True) if d["role"]}
        self.assertEqual(roles["forward/primals_1"], "input")  # x: no gradient
        self.assertEqual(roles["forward/primals_2"], "parameter")  # w
        self.assertIn("activation", roles.values())
        # w's gradient is laid out like w.
        (grad_use,) = [u for u in uses(graph, "forward/primals_2") if u[0].startswith("backward/")]
        self.assertEqual(grad_use[1:], ("value", 0, 1))

    def test_a_joint_graph_from_make_fx(self):
        def train_step(x, w):
            w = w.detach().requires_grad_()
            loss = (x @ w).relu().sum()
            (grad,) = torch.autograd.grad(loss, w)
            return loss, grad

        gm = make_fx(train_step)(torch.randn(8, 4), torch.randn(4, 6))
        graph = passes.placement_graph(gm, LINE)
        ops = {d["op"] for _, d in graph.nodes(data=True)}
        self.assertIn("aten.mm.default", ops)
        self.assertIn("aten.threshold_backward.default", ops)
        self.assertFalse(graph.graph["unsupported_ops"])


class TestMetaFree(TestCase):
    def test_deleted_metadata_is_recomputed_from_example_inputs(self):
        region = hops.local_map(lambda a: a * 2, mesh=GRID, in_placements=((S0, R),), out_placements=(S0, R))

        def program(h, ws):
            last, ys = hops.scan(step, region(h), ws)
            return last.sum() + ys.sum()

        args = (torch.randn(4, 8), torch.randn(3, 8, 8))
        gm = make_fx(program)(*args)
        with_meta = passes.placement_graph(gm, GRID)
        delete_meta(gm)
        with self.assertRaisesRegex(passes.PassError, "metadata was deleted .*pass example_inputs="):
            passes.placement_graph(gm, GRID)
        without_meta = passes.placement_graph(gm, GRID, example_inputs=args)
        self.assertEqual(summary(without_meta), summary(with_meta))
        for key, data in with_meta.nodes(data=True):
            self.assertEqual(without_meta.nodes[key]["strategies"], data["strategies"], key)
        self.assertEqual(sorted(without_meta.edges), sorted(with_meta.edges))

    def test_a_forward_and_backward_without_metadata(self):
        x, w = torch.randn(8, 4), torch.randn(4, 6, requires_grad=True)
        forward, backward, _ = aot_trace(lambda x, w: (x @ w).relu(), x, w)
        with_meta = passes.placement_graph((forward, backward), LINE)
        delete_meta(forward)
        delete_meta(backward)
        without_meta = passes.placement_graph((forward, backward), LINE, example_inputs=(x, w))
        self.assertEqual(summary(without_meta), summary(with_meta))


if __name__ == "__main__":
    pytest.main([__file__])
