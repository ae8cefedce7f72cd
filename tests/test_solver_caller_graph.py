"""The solver reads what it is handed and writes none of it: a solve leaves the caller's program
(every node, its ``meta``, the graphs' attributes) and the caller's ``placement_graph`` (graph,
node and edge attributes) as they were, and keeps what it caches in its own objects, so a second
solve of a graph changed since the first prices the graph as it is now."""

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, RegionPlacements, Replicate, Shard, ShardingSpec
from passes.solver import CostModel, placement_graph
from passes.solver.graph import NodeKind, UseKind
from passes.solver.solve import evaluate_placements, node_costs, solve_graph
from passes.solver.unrolled import scan_plan_on_unrolled, unrolled_graph
from tests.helpers.snapshot import TestCase, aot_trace

LINE = Mesh.of(model=4)
R, S0, S1 = Replicate(), Shard(0), Shard(1)
# Memory-bound (FLOPs nearly free): a region costs the bytes its body moves on its local shapes.
MEMORY_BOUND = CostModel(peak_flops=1e18, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6)
COMPUTE_BOUND = CostModel(peak_flops=1e9, memory_bandwidth=1e18, link_bandwidth=1e8, link_latency=1e-6)


def projection():
    """``x @ w`` as a region: row-parallel, or (an alternative on other local shapes) column-parallel;
    no cost hints, so the solver prices each alternative by its own body."""
    return hops.local_map(
        lambda x, w: x @ w, mesh=LINE, in_placements=((S0,), (R,)), out_placements=((S0,),),
        alternatives=[RegionPlacements("R, S(1)", "S(1)")],
    )


def region_program():
    region = projection()

    def program(x, w):
        return region(hops.annotate_sharding(x.sin(), ShardingSpec(LINE, (R,))), w).cos()

    return make_fx(program)(torch.randn(32, 64), torch.randn(64, 16))


def step(h, w):
    h = torch.tanh(h @ w)
    return h, h.sin()


def scan_program():
    """A scan's forward and backward (carries, stacked xs and ys, saved values)."""
    forward, backward, _ = aot_trace(
        lambda h, ws: sum(t.sum() for t in hops.scan(step, h, ws)), torch.randn(8, 16), torch.randn(3, 16, 16, requires_grad=True)
    )
    return forward, backward


def freeze(value):
    """``value`` as a comparable record: containers by their contents, every other object by
    identity (a solve must not rebind even an equal value)."""
    if isinstance(value, dict):
        return ("dict", tuple((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return (type(value).__name__, tuple(freeze(v) for v in value))
    if hasattr(value, "_fields"):  # a NamedTuple: its fields
        return (type(value).__name__, tuple(freeze(v) for v in value))
    return ("object", id(value))


def program_record(program):
    """Every graph of ``program`` (bodies included): its attributes, and each node's name, op,
    target, arguments, users and ``meta``."""
    modules = program if isinstance(program, tuple) else (program,)
    record = []
    for root in modules:
        for name, module in root.named_modules():
            if not isinstance(module, fx.GraphModule):
                continue
            graph = module.graph
            attributes = {k: v for k, v in vars(graph).items() if k not in ("_len", "_graph_namespace")}
            nodes = [
                (node.name, node.op, id(node.target), freeze(node.args), freeze(node.kwargs), tuple(map(id, node.users)),
                 freeze(node.meta))
                for node in graph.nodes
            ]
            record.append((name, sorted(vars(module)), freeze(attributes), nodes, module.code))
    return record


def graph_record(graph):
    """The placement graph's attributes, and each node's and edge's."""
    return (
        freeze(graph.graph),
        [(key, freeze(data)) for key, data in graph.nodes(data=True)],
        [(u, v, freeze(data)) for u, v, data in graph.edges(data=True)],
    )


class TestTheCallersGraphIsLeftAlone(TestCase):
    def test_a_solve_leaves_the_program_and_its_placement_graph_as_they_were(self):
        for name, make, mesh in (("region", region_program, LINE), ("scan", scan_program, Mesh((2, 2), ("data", "model")))):
            with self.subTest(program=name):
                program = make()
                before = program_record(program)
                solution = passes.solve_placements(program, mesh, cost_model=MEMORY_BOUND)
                self.assertEqual(program_record(program), before)

                graph = placement_graph(program, mesh)
                graph_before = graph_record(graph)
                for cost_model in (MEMORY_BOUND, COMPUTE_BOUND):
                    solution = solve_graph(graph, cost_model=cost_model)
                    evaluate_placements(graph, solution.strategies, cost_model)
                    node_costs(solution)
                    solution.collectives()
                    passes.format_placements(program, solution)
                self.assertEqual(graph_record(graph), graph_before)
                self.assertEqual(program_record(program), before)

    def test_a_second_solve_prices_the_graph_as_it_is_now(self):
        program = region_program()
        (region,) = [k for k, d in placement_graph(program, LINE).nodes(data=True) if d["kind"] is NodeKind.REGION]

        def solved(graph, cost_model):
            solution = solve_graph(graph, cost_model=cost_model)
            return solution.cost, node_costs(solution)[region][0]

        # Another cost model on the same graph: the region priced by the one given now.
        graph = placement_graph(program, LINE)
        solved(graph, MEMORY_BOUND)
        self.assertEqual(solved(graph, COMPUTE_BOUND), solved(placement_graph(program, LINE), COMPUTE_BOUND))

        # The graph changed between two solves (each alternative's body values made 4x larger, as a
        # caller editing the graph would): priced as a fresh graph with the same change.
        graph, twin = placement_graph(program, LINE), placement_graph(program, LINE)
        first = solved(graph, MEMORY_BOUND)
        for g in (graph, twin):
            for _, data in g.nodes(data=True):
                if data["kind"] is NodeKind.LOCAL and data["shape"]:
                    data["shape"] = (4 * data["shape"][0], *data["shape"][1:])
        again = solved(graph, MEMORY_BOUND)
        self.assertEqual(again, solved(twin, MEMORY_BOUND))
        self.assertNotEqual(again, first)

    def test_a_region_in_a_scan_is_priced_on_its_own_body_in_every_unrolled_step(self):
        # Each step's copy of a region is priced on that step's copy of its body, once: the scan
        # plan costs its objective on the unrolled program, whether or not that graph was
        # unrolled from one solved before (no figure carried over from another graph).
        region = projection()

        def program(h, ws):
            return hops.scan(lambda h, w: (region(h, w).tanh(), h.sin()), h, ws)

        gm = make_fx(program)(torch.randn(32, 16), torch.randn(3, 16, 16))
        graph = placement_graph(gm, LINE)
        fresh, origin = unrolled_graph(graph)
        solution = solve_graph(graph, cost_model=MEMORY_BOUND)
        self.assertIn(NodeKind.REGION, [d["kind"] for _, d in fresh.nodes(data=True)])
        for unrolled in (fresh, unrolled_graph(solution.graph)[0]):
            plan = scan_plan_on_unrolled(unrolled, origin, solution)
            self.assertAlmostEqual(evaluate_placements(unrolled, plan, MEMORY_BOUND), solution.cost, delta=1e-9 * solution.cost)


class TestKinds(TestCase):
    def test_every_node_and_read_has_a_typed_kind_and_a_text_kind_is_refused(self):
        graph = placement_graph(scan_program(), Mesh((2, 2), ("data", "model")))
        kinds = {data["kind"] for _, data in graph.nodes(data=True)}
        self.assertTrue(all(isinstance(kind, NodeKind) for kind in kinds))
        self.assertEqual(kinds, {NodeKind.INPUT, NodeKind.OP, NodeKind.ALIAS, NodeKind.OUTPUT})
        self.assertEqual(placement_graph(region_program(), LINE).nodes["hops_local_map"]["kind"], NodeKind.REGION)
        reads = {use.kind for _, _, data in graph.edges(data=True) for use in data["uses"]}
        self.assertEqual(reads, set(UseKind))  # a scan's forward and backward read in every way
        self.assertEqual(f"{NodeKind.LOCAL}/{NodeKind.REGION!s}", "local/region")  # printed as its text
        # Code written against the text kinds fails where it compares, not by matching nothing.
        with self.assertRaisesRegex(TypeError, "compare it with NodeKind members, not 'local'"):
            _ = NodeKind.LOCAL == "local"
        with self.assertRaisesRegex(TypeError, "not 'input'"):
            _ = NodeKind.REGION in ("input", "region")
        with self.assertRaisesRegex(TypeError, "a placement graph kind is a UseKind: .* not 'carry'"):
            _ = UseKind.CARRY == "carry"
