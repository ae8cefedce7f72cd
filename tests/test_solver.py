"""solve_placements: the optimum (checked by brute force), fixed placements honoured, memory
budgets bind or are refused, a scan solved once, the cost model, meta-free."""

import itertools
import math
import unittest.mock

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec
from passes.solver import CostModel, InfeasiblePlacementError, NoPlanFoundError, StrategyProblem, peak_usage, problem_cost, solve_problem
from passes.solver import solve as solve_module
from passes.solver.solve import Factor, MemoryTerm, choice_problem, full_plan, placement_problem, solve_graph
from tests.helpers.snapshot import TestCase, aot_trace, delete_meta

LINE = Mesh((2,), ("data",))
GRID = Mesh((2, 2), ("data", "model"))
R, S0, S1 = Replicate(), Shard(0), Shard(1)
# A slow link makes communication matter at test sizes.
SLOW_LINK = CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6)


class Choices:
    """A problem of choices, factors and memory terms (``choice_problem``, the FX front's
    encoding: a choice's further terms as tied nodes), enumerated over the choices' options."""

    def __init__(self, costs, factors, terms=(), budget=None):
        self.costs, self.factors, self.terms = costs, factors, list(terms)
        self.problem, self.ties = choice_problem(costs, factors, self.terms, budget)

    @classmethod
    def of(cls, problem):
        """A problem already built (no ties), enumerated over its nodes."""
        choices = object.__new__(cls)
        choices.costs, choices.problem, choices.ties = problem.node_costs, problem, []
        return choices

    def cost(self, options):
        return problem_cost(self.problem, full_plan(self.ties, options))

    def memory(self, options):
        return peak_usage(self.problem, full_plan(self.ties, options))


def brute_force(choices):
    budget = choices.problem.usage_limit
    best, best_options = float("inf"), None
    for options in itertools.product(*(range(len(c)) for c in choices.costs)):
        if budget is not None and choices.memory(options) > budget + 1e-9:
            continue
        cost = choices.cost(options)
        if cost < best:
            best, best_options = cost, options
    return best, best_options


def random_factors(rng, costs, factors=8, forbid=0.15):
    out = []
    for _ in range(factors):
        a, b = rng.choice(len(costs), size=2, replace=False)
        na, nb = len(costs[a]), len(costs[b])
        rows = rng.integers(0, max(1, na - 1), size=na)
        cols = rng.integers(0, max(1, nb - 1), size=nb)
        table = rng.uniform(0, 5, size=(rows.max() + 1, cols.max() + 1))
        table[rng.uniform(size=table.shape) < forbid] = np.inf
        out.append(Factor(int(a), int(b), rows, cols, table))
    return out


class TestExactness(TestCase):
    def assert_random_problems_match_brute_force(self, make_problem, seed):
        """40 problems from ``make_problem(rng) -> Choices``, solved with and without the
        eliminations: the brute-force optimum under the budget, or refused where none exists."""
        rng = np.random.default_rng(seed)
        solved = infeasible = 0
        for _ in range(40):
            choices = make_problem(rng)
            budget = choices.problem.usage_limit
            expected, _ = brute_force(choices)
            for reduce in (True, False):
                if not np.isfinite(expected):
                    with self.assertRaises(InfeasiblePlacementError):
                        solve_problem(choices.problem, reduce=reduce)
                    infeasible += 1
                    continue
                result = solve_problem(choices.problem, reduce=reduce)
                options = result.strategies[: len(choices.costs)]
                self.assertEqual(full_plan(choices.ties, options), result.strategies)  # ties follow their choice
                self.assertAlmostEqual(result.cost, expected, places=6)
                self.assertAlmostEqual(choices.cost(options), expected, places=6)
                if budget is not None:
                    self.assertLessEqual(choices.memory(options), budget + 1e-9)
                solved += 1
        self.assertGreater(solved, 20)
        self.assertGreater(infeasible, 0)

    def test_random_problems_match_brute_force_with_and_without_reductions(self):
        # Memory as one sum: every choice live at the one time step 0.
        def make_problem(rng):
            costs = [rng.uniform(0, 5, size=n) for n in rng.integers(1, 5, size=6)]
            terms = [MemoryTerm(i, 0, 1, rng.integers(0, 10, size=len(c)).astype(float)) for i, c in enumerate(costs)]
            budget = float(rng.integers(10, 40)) if rng.uniform() < 0.5 else None
            return Choices(costs, random_factors(rng, costs), terms, budget)

        self.assert_random_problems_match_brute_force(make_problem, seed=0)

    def test_random_problems_with_live_memory_match_brute_force(self):
        # Memory over time: each term is live on [start, end) and the budget bounds the peak
        # of the live terms' usages; choices may have several terms (tied nodes), or none.
        def make_problem(rng):
            costs = [rng.uniform(0, 5, size=n) for n in rng.integers(1, 5, size=6)]
            terms = [
                MemoryTerm(int(c), int(start), int(start + rng.integers(1, 6)), rng.integers(0, 10, size=len(costs[c])).astype(float))
                for c, start in zip(rng.integers(0, len(costs), size=8), rng.integers(0, 10, size=8))
            ]
            return Choices(costs, random_factors(rng, costs), terms, float(rng.integers(12, 36)))

        self.assert_random_problems_match_brute_force(make_problem, seed=2)

    def test_the_peak_counts_the_terms_live_together(self):
        usage = np.array([4.0, 1.0])
        terms = [MemoryTerm(0, 0, 2, usage), MemoryTerm(1, 2, 4, usage), MemoryTerm(2, 1, 3, usage), MemoryTerm(0, 3, 4, usage)]
        choices = Choices([np.zeros(2)] * 3, [], terms)
        self.assertEqual(choices.memory([0, 0, 0]), 8.0)  # two of the first three at any time
        self.assertEqual(choices.memory([0, 1, 1]), 5.0)  # c0 with c2 at t = 1, c0's second term with c1 at t = 3
        self.assertEqual(choices.memory([1, 0, 1]), 5.0)  # c1 with c2 at t = 2

    def test_a_chain_and_a_tree_need_no_integer_program(self):
        rng = np.random.default_rng(1)
        chain = [rng.uniform(0, 5, size=3) for i in range(8)]
        factors = [Factor(i, i + 1, np.arange(3), np.arange(3), rng.uniform(0, 5, size=(3, 3))) for i in range(7)]
        factors.append(Factor(2, 0, np.arange(3), np.arange(3), rng.uniform(0, 5, size=(3, 3))))  # a triangle
        choices = Choices(chain, factors)
        result = solve_problem(choices.problem)
        self.assertAlmostEqual(result.cost, brute_force(choices)[0], places=6)
        self.assertEqual(result.stats["variables"], 0)

    def test_a_matmul_chain_on_a_mesh_matches_brute_force(self):
        gm = make_fx(lambda x, w1, w2: torch.relu(x @ w1) @ w2)(torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 2))
        graph = passes.placement_graph(gm, LINE)
        problem, owners = placement_problem(graph, SLOW_LINK)
        self.assertEqual(problem.num_nodes, len(owners))  # (no value outside a choice's own term here)
        expected, options = brute_force(Choices.of(problem))
        solution = solve_graph(graph, cost_model=SLOW_LINK)
        self.assertAlmostEqual(solution.cost, expected, places=12)
        # The same choices, up to ties.
        chosen = [graph.nodes[k]["strategies"].index(solution.strategies[k]) for k in owners]
        self.assertAlmostEqual(problem_cost(problem, chosen), problem_cost(problem, options), places=12)

    def test_the_optimum_is_the_same_with_and_without_eliminations_and_by_search_policy(self):
        gm = make_fx(lambda x, w1, w2: torch.relu(x @ w1) @ w2)(torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4))
        graph = passes.placement_graph(gm, GRID)
        costs = {
            (search, reduce): solve_graph(graph, cost_model=SLOW_LINK, search=search, reduce=reduce).cost
            for search in ("auto", "exact")
            for reduce in (True, False)
        }
        self.assertEqual(len({round(c, 12) for c in costs.values()}), 1, costs)


class TestFixedPlacements(TestCase):
    def test_annotations_and_regions_are_honoured_even_when_costly(self):
        replicated = ShardingSpec(GRID, (R, R))
        region = hops.local_map(
            lambda a, b: a @ b, mesh=GRID, in_placements=((S0, R), (R, S1)), out_placements=(S0, S1)
        )

        def program(x, w):
            h = hops.annotate_sharding(x.sin(), replicated)  # forces a gather of a large value
            return region(h, w).cos()

        gm = make_fx(program)(torch.randn(64, 32), torch.randn(32, 64))
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        self.assertEqual(solution.placements["hops_sharding_annotation"], (R, R))
        self.assertEqual(solution.strategies["hops_local_map"].inputs, ((S0, R), (R, S1)))
        self.assertEqual(solution.placements["getitem"], (S0, S1))
        # What is not fixed follows the fixed layouts: sin runs replicated, cos on the region's layout.
        self.assertEqual(solution.placements["cos"], (S0, S1))


class TestUnitMeshAxes(TestCase):
    """On a mesh axis of size 1 every layout is the whole value: inserting such axes changes
    neither the optimum nor the problem's size (each op's strategies would otherwise multiply
    by the axis's layouts: 1.7M variables for 72k on examples/auto_shard.py's 2x2x1 mesh)."""

    @staticmethod
    def program(mesh, data_axis):
        # An annotation stating a Shard on every axis (on a size-1 axis too) and a region.
        shard_rows = tuple(S0 if i == data_axis or mesh.shape[i] == 1 else R for i in range(mesh.ndim))
        everywhere = ShardingSpec(mesh, tuple(S0 if i == data_axis else S1 if mesh.shape[i] == 1 else R for i in range(mesh.ndim)))
        region = hops.local_map(lambda a, b: a @ b, mesh=mesh, in_placements=(shard_rows, tuple(R for _ in mesh.shape)), out_placements=(shard_rows,))

        def program(x, w1, w2):
            h = hops.annotate_sharding(torch.relu(x @ w1), everywhere)
            return region(h, w2).cos().sum()

        return program

    def test_the_optimum_and_problem_size_do_not_depend_on_unit_axes(self):
        inputs = (torch.randn(16, 8), torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True))
        meshes = {
            "2": (Mesh((2,), ("data",)), 0),
            "2x1": (Mesh((2, 1), ("data", "tensor")), 0),
            "1x2x1": (Mesh((1, 2, 1), ("pipe", "data", "tensor")), 1),
        }
        solved = {}
        for name, (mesh, data_axis) in meshes.items():
            forward, backward, _ = aot_trace(self.program(mesh, data_axis), *inputs)
            graph = passes.placement_graph((forward, backward), mesh)
            problem, owners = placement_problem(graph, SLOW_LINK)
            solution = solve_graph(graph, cost_model=SLOW_LINK, search="exact")
            self.assertEqual(solution.stats["status"], "optimal", name)
            # The plan applies and checks: the region states Shard(0) on a size-1 axis where
            # the plan's annotations say Replicate, the same layout there.
            passes.apply_placements((forward, backward), solution)
            for gm in (forward, backward):
                passes.check_placements(gm)
            for key in owners:
                for strategy in graph.nodes[key]["strategies"]:
                    for placements in strategy.outputs + strategy.inputs:
                        for size, p in zip(mesh.shape, placements or ()):
                            self.assertTrue(size > 1 or p == R, (name, key, strategy))
            solved[name] = (solution.cost, sum(len(c) for c in problem.node_costs))
        (cost, size), *others = solved.values()
        for name, (other_cost, other_size) in zip(list(solved)[1:], others):
            self.assertAlmostEqual(other_cost, cost, delta=1e-12 * max(1.0, cost), msg=name)
            self.assertEqual(other_size, size, name)


class TestMemoryBudget(TestCase):
    def mlp_graphs(self):
        x = torch.randn(16, 32)
        w1 = torch.randn(32, 64, requires_grad=True)
        w2 = torch.randn(64, 32, requires_grad=True)
        forward, backward, _ = aot_trace(lambda x, w1, w2: torch.relu(x @ w1) @ w2, x, w1, w2)
        return forward, backward

    def test_a_budget_below_the_replicated_footprint_makes_the_solver_shard(self):
        forward, backward = self.mlp_graphs()
        fast_link = CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e12, link_latency=1e-3)
        free = passes.solve_placements((forward, backward), GRID, cost_model=fast_link)
        # Latency dominates: without a budget nothing is worth a collective.
        self.assertEqual(free.placements["forward/primals_2"], (R, R))
        self.assertEqual(free.placements["forward/primals_3"], (R, R))
        params = 4 * (32 * 64 + 64 * 32) * (2 + fast_link.optimizer_state_bytes)
        self.assertGreaterEqual(free.memory, params)
        budget = free.memory / 2
        bound = passes.solve_placements((forward, backward), GRID, cost_model=fast_link, memory_budget=budget)
        self.assertLessEqual(bound.memory, budget)
        self.assertGreater(bound.cost, free.cost)
        sharded = [k for k in ("forward/primals_2", "forward/primals_3") if bound.placements[k] != (R, R)]
        self.assertTrue(sharded, bound.placements)

    def test_without_a_time_limit_a_budgeted_solve_answers_where_its_timed_search_found_no_plan(self):
        # The budgeted search gets a share of the unbudgeted call's time. Given none here, it
        # finds no plan (the cheapest strategies break the budget, the smallest make a forbidden
        # pair); the call asked for no time limit, so it still answers, with the optimum.
        table = np.array([[0.0, 0.0], [0.0, math.inf]])
        problem = StrategyProblem([np.array([0.0, 5.0])] * 2, [np.array([10.0, 1.0])] * 2, [[0, 1]] * 2, [(0, 1)], [table])
        with unittest.mock.patch.object(solve_module, "_BUDGET_TIME_FACTOR", 0.0), unittest.mock.patch.object(
            solve_module, "_BUDGET_MIN_SECONDS", 1e-9
        ):
            with self.assertRaises(NoPlanFoundError):  # (the timed search alone)
                solve_problem(problem.with_usage_limit(11.0), time_limit=1e-9)
            result = solve_module._solve_with_budget(problem.with_usage_limit(11.0), 11.0, None, True, "auto")
        self.assertEqual(result.cost, 5.0)
        self.assertEqual(result.stats["status"], "optimal")

    def test_memory_is_the_peak_of_the_values_live_together(self):
        # Two products are made and summed one after the other: the second is made after the
        # first was read for the last time, so the peak holds the inputs and one product.
        def program(x, w, v):
            return (x @ w).sum() + (x @ v).sum()

        x, w, v = torch.randn(64, 32), torch.randn(32, 128), torch.randn(32, 128)
        gm = make_fx(program)(x, w, v)
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        placed = solution.placements

        def local_bytes(key, shape):
            ways = math.prod(n for n, p in zip(GRID.shape, placed[key]) if isinstance(p, Shard))
            return 4 * math.prod(shape) / ways

        inputs = local_bytes("x_1", x.shape) + local_bytes("w_1", w.shape) + local_bytes("v_1", v.shape)
        products = [local_bytes(key, (64, 128)) for key in ("mm", "mm_1")]
        scalars = 3 * 4  # two sums and their sum, replicated or pending: 4 bytes each at most
        self.assertGreaterEqual(solution.memory, inputs + max(products))
        self.assertLessEqual(solution.memory, inputs + max(products) + scalars)
        # What the sum of every value would give instead: both products at once.
        self.assertLess(solution.memory, inputs + sum(products))

    def test_an_infeasible_budget_is_refused_with_the_smallest_footprint(self):
        forward, backward = self.mlp_graphs()
        with self.assertRaisesRegex(
            InfeasiblePlacementError, r"memory_budget=1000 bytes per device is below the smallest footprint any placement allows \(\d+ bytes"
        ):
            passes.solve_placements((forward, backward), GRID, memory_budget=1000)

    def test_bad_budget_and_cost_model_arguments(self):
        forward, backward = self.mlp_graphs()
        with self.assertRaisesRegex(ValueError, "memory_budget=...\\) must be a positive number of bytes per device, got -1"):
            passes.solve_placements((forward, backward), GRID, memory_budget=-1)
        with self.assertRaisesRegex(TypeError, "cost_model=...\\) must be a CostModel, got str"):
            passes.solve_placements((forward, backward), GRID, cost_model="h100")


def step(h, w):
    h = torch.tanh(h @ w)
    return h, h.sum(-1)


def scanned(h, ws):
    last, ys = hops.scan(step, h, ws)
    return last.sum() + ys.sum()


class TestScan(TestCase):
    def test_a_scan_is_solved_once_whatever_its_length(self):
        solutions = {}
        for length in (2, 6):
            forward, backward, _ = aot_trace(scanned, torch.randn(8, 16), torch.randn(length, 16, 16, requires_grad=True))
            solutions[length] = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK)
        self.assertEqual(solutions[2].stats["variables"], solutions[6].stats["variables"])
        self.assertEqual(solutions[2].stats["constraints"], solutions[6].stats["constraints"])
        self.assertGreater(solutions[6].cost, 2 * solutions[2].cost)
        # The body's placements hold at every step: one placement per body value.
        body = [k for k in solutions[6].placements if "step_body_0/" in k]
        self.assertTrue(body)

    def test_the_scan_plan_measured_on_the_unrolled_graph(self):
        from passes.solver.solve import evaluate_placements
        from passes.solver.unrolled import scan_plan_on_unrolled, unrolled_graph

        forward, backward, _ = aot_trace(scanned, torch.randn(8, 16), torch.randn(3, 16, 16, requires_grad=True))
        scan_solution = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK)
        unrolled, origin = unrolled_graph(scan_solution.graph)
        # One copy of each body value per step; no body value left uncopied.
        self.assertEqual(sum(1 for k in origin if origin[k] == "forward/step_body_0/mm"), 3)
        self.assertNotIn("forward/step_body_0/mm", unrolled)
        plan = scan_plan_on_unrolled(unrolled, origin, scan_solution)
        measured = evaluate_placements(unrolled, plan, SLOW_LINK)
        optimum = solve_graph(unrolled, cost_model=SLOW_LINK)
        # Per-step placements can only do better than one placement for every step.
        self.assertLessEqual(optimum.cost, measured * (1 + 1e-9))
        self.assertGreater(optimum.stats["choices"], scan_solution.stats["choices"])

    def test_an_unrolled_program_has_no_body_left(self):
        forward, backward, _ = aot_trace(scanned, torch.randn(8, 16), torch.randn(3, 16, 16, requires_grad=True))
        unrolled = (passes.unroll_scan(forward), passes.unroll_scan(backward))
        solution = passes.solve_placements(unrolled, GRID, cost_model=SLOW_LINK)
        self.assertFalse([k for k in solution.placements if "_body_" in k])
        self.assertEqual(solution.stats["status"], "optimal")


class TestCostModel(TestCase):
    def test_collectives_are_priced_per_mesh_axis(self):
        model = CostModel(peak_flops=1e12, memory_bandwidth=1e11, link_bandwidth=(1e9, 1e10), link_latency=(1e-5, 1e-6))
        shape, itemsize = (64, 64), 4
        local = 64 * 64 * 4 / 2
        # All-gather over "data" (axis 0): one latency plus (n-1) local shards.
        self.assertAlmostEqual(model.redistribute_seconds(shape, itemsize, (S0, R), (R, R), GRID), 1e-5 + local / 1e9)
        # The same over "model" uses its faster link.
        self.assertAlmostEqual(model.redistribute_seconds(shape, itemsize, (R, S0), (R, R), GRID), 1e-6 + local / 1e10)
        # All-reduce: 2 (n-1)/n of the whole value.
        self.assertAlmostEqual(
            model.redistribute_seconds(shape, itemsize, (Partial(), R), (R, R), GRID), 1e-5 + 2 * 0.5 * 64 * 64 * 4 / 1e9
        )
        # Slicing a replicated value is a local copy of the slice.
        self.assertAlmostEqual(model.redistribute_seconds(shape, itemsize, (R, R), (S0, R), GRID), local / 1e11)

    def test_compute_is_a_roofline_on_local_shapes(self):
        model = CostModel(peak_flops=1e9, memory_bandwidth=1e12, link_bandwidth=1e9, link_latency=0)
        mm = torch.ops.aten.mm.default
        self.assertAlmostEqual(model.compute_seconds(mm, [(64, 32), (32, 16)], [(64, 16)], 4), 2 * 64 * 32 * 16 / 1e9)
        self.assertEqual(model.compute_seconds(torch.ops.aten.view.default, [(64, 32)], [(2048,)], 4), 0.0)

    def test_presets_and_bad_parameters(self):
        h100 = CostModel.preset("h100", link_bandwidth=(50e9, 450e9))
        self.assertEqual(h100.link_bandwidth, (50e9, 450e9))
        self.assertEqual(h100.peak_flops, passes.solver.PRESETS["h100"].peak_flops)
        with self.assertRaisesRegex(ValueError, "unknown device 'b200'; presets are"):
            CostModel.preset("b200")
        with self.assertRaisesRegex(ValueError, "peak_flops=...\\) must be a positive number, got 0"):
            CostModel(peak_flops=0, memory_bandwidth=1, link_bandwidth=1, link_latency=0)
        with self.assertRaisesRegex(ValueError, "link_bandwidth has 3 entries but the mesh has 2 axes"):
            CostModel(1, 1, (1, 1, 1), 0).redistribute_seconds((4, 4), 4, (S0, R), (R, R), GRID)


class TestMetaFree(TestCase):
    def test_the_same_solution_without_metadata(self):
        args = (torch.randn(8, 16), torch.randn(3, 16, 16, requires_grad=True))
        forward, backward, _ = aot_trace(scanned, *args)
        with_meta = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK)
        printed = passes.format_placements((forward, backward), with_meta)
        delete_meta(forward)
        delete_meta(backward)
        without_meta = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK, example_inputs=args)
        self.assertEqual(without_meta.placements, with_meta.placements)
        self.assertEqual(without_meta.cost, with_meta.cost)
        self.assertEqual(passes.format_placements((forward, backward), without_meta), printed)
        # Applied without metadata, the program states the same layouts as a twin with it.
        twin_forward, twin_backward, _ = aot_trace(scanned, *args)
        passes.apply_placements((twin_forward, twin_backward), passes.solve_placements(
            (twin_forward, twin_backward), GRID, cost_model=SLOW_LINK))
        passes.apply_placements((forward, backward), without_meta)
        self.assertEqual(stated_layouts(forward), stated_layouts(twin_forward))
        self.assertEqual(stated_layouts(backward), stated_layouts(twin_backward))
        self.assertTrue(stated_layouts(forward))


def stated_layouts(gm):
    return [
        (name, node.args[0].name, node.args[1].placements)
        for name, module in gm.named_modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target is hops.sharding_annotation_hop
    ]


if __name__ == "__main__":
    pytest.main([__file__])


def test_a_solve_in_the_callers_process_prints_nothing():
    # HiGHS prints its banner to fd 1 when a process makes its first solver object, before any
    # option can be set; a solve without a time limit runs in the caller's process (a fresh
    # one here: the banner comes once per process), whose stdout is the user's.
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        from passes.solver import solve_problem
        from passes.solver.families import contest_like
        solve_problem(contest_like(0, nodes=40, forbidden=0.0))
        print("solved")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "solved\n", done.stdout
