"""Placement alternatives of a local_map region (``hops.local_map(..., alternatives=...)``):
the solver chooses one, apply_placements switches the region to it."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, RegionPlacements, Replicate, Shard, ShardingSpec
from passes.solver import CostModel
from tests.helpers.snapshot import TestCase

GRID = Mesh((2, 2), ("data", "model"))
R, S0 = Replicate(), Shard(0)
SLOW_LINK = CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6)

ROWS_ON_DATA = ((S0, R),)  # rows split over "data"
ROWS_ON_MODEL = ((R, S0),)  # rows split over "model": the same local shapes on a 2x2 mesh


def double(a):
    return a * 2


def traced_with_alternatives(*hints, annotated=True):
    """A region whose options are rows over "data" (its main placements) and rows over
    "model", between annotations that want rows over "model" (or none)."""
    region = hops.local_map(
        double,
        mesh=GRID,
        in_placements=ROWS_ON_DATA,
        out_placements=ROWS_ON_DATA[0],
        alternatives=[RegionPlacements(ROWS_ON_MODEL, ROWS_ON_MODEL, cost_hint=hints[1] if hints else None)],
    )

    def program(x):
        if annotated:
            x = hops.annotate_sharding(x, ShardingSpec(GRID, ROWS_ON_MODEL[0]))
        y = region(x.sin()).cos()
        return hops.annotate_sharding(y, ShardingSpec(GRID, ROWS_ON_MODEL[0])) if annotated else y

    gm = make_fx(program)(torch.randn(64, 64))
    if hints:  # the main option's hint: set on the traced spec, as a solver author may
        node = next(n for n in gm.graph.nodes if n.target is hops.local_map_hop)
        spec = node.args[-1]
        main = RegionPlacements(spec.in_placements, spec.out_placements, cost_hint=hints[0])
        node.args = (*node.args[:-1], hops.LocalMapSpec(spec.mesh, spec.in_placements, spec.out_placements, None, (main, spec.alternatives[1])))
        gm.recompile()
    return gm, program


class TestRegionAlternatives(TestCase):
    def test_the_solver_chooses_the_alternative_its_neighbours_want_and_apply_switches_to_it(self):
        gm, program = traced_with_alternatives()
        x = torch.randn(64, 64)
        expected = program(x)
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        self.assertEqual(solution.region_choice("hops_local_map"), 1)
        self.assertEqual(solution.placements["getitem"], ROWS_ON_MODEL[0])
        passes.apply_placements(gm, solution)
        node = next(n for n in gm.graph.nodes if n.target is hops.local_map_hop)
        self.assertEqual(node.args[-1].in_placements, ROWS_ON_MODEL)
        self.assertEqual(node.args[-1].active, 1)
        passes.check_placements(gm)
        self.assertEqual(gm(x), expected)
        self.assertIn("alternative 1 of 2", passes.format_placements(gm, solution))

    def test_with_the_layouts_equal_the_cost_hint_decides(self):
        # Unannotated, the two options are mirror images on a square mesh: only the hint differs.
        for cheap in (0, 1):
            hints = [1.0, 1.0]
            hints[cheap] = 1e-6
            gm, _ = traced_with_alternatives(*hints, annotated=False)
            solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
            self.assertEqual(solution.region_choice("hops_local_map"), cheap)

    def test_a_region_without_alternatives_is_fixed(self):
        region = hops.local_map(double, mesh=GRID, in_placements=ROWS_ON_DATA, out_placements=ROWS_ON_DATA[0])
        gm = make_fx(lambda x: hops.annotate_sharding(region(x.sin()).cos(), ShardingSpec(GRID, ROWS_ON_MODEL[0])))(torch.randn(64, 64))
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        self.assertEqual(solution.region_choice("hops_local_map"), 0)
        self.assertEqual(solution.strategies["hops_local_map"].inputs, ROWS_ON_DATA)


if __name__ == "__main__":
    pytest.main([__file__])
