"""Placement alternatives of a local_map region: the solver chooses one, apply_placements
switches the region to it.

``LocalMapSpec`` gets its typed ``alternatives`` in hops (see the solver's request); until then
these tests put a stand-in spec with the same fields on the traced region node.
"""

import dataclasses
from typing import NamedTuple

import pytest
import torch
from snapshot import TestCase
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import LocalMapSpec, Mesh, Replicate, Shard, ShardingSpec
from passes.solver import CostModel

GRID = Mesh((2, 2), ("data", "model"))
R, S0 = Replicate(), Shard(0)
SLOW_LINK = CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6)


class Alternative(NamedTuple):
    in_placements: tuple
    out_placements: tuple
    in_grad_placements: tuple | None = None
    cost_hint: float | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class SpecWithAlternatives(LocalMapSpec):
    """Stand-in for LocalMapSpec with alternatives: its own fields are the active ones."""

    alternatives: tuple = ()

    def choose(self, index: int) -> "SpecWithAlternatives":
        chosen = self.alternatives[index]
        return dataclasses.replace(
            self, in_placements=chosen.in_placements, out_placements=chosen.out_placements,
            in_grad_placements=chosen.in_grad_placements,
        )


ROWS_ON_DATA = ((S0, R),)  # rows split over "data"
ROWS_ON_MODEL = ((R, S0),)  # rows split over "model": the same local shapes on a 2x2 mesh


def double(a):
    return a * 2


region = hops.local_map(double, mesh=GRID, in_placements=ROWS_ON_DATA, out_placements=ROWS_ON_DATA[0])


def program(x):
    x = hops.annotate_sharding(x, ShardingSpec(GRID, ROWS_ON_MODEL[0]))
    return hops.annotate_sharding(region(x.sin()).cos(), ShardingSpec(GRID, ROWS_ON_MODEL[0]))


def traced_with_alternatives(*alternatives):
    gm = make_fx(program)(torch.randn(64, 64))
    node = next(n for n in gm.graph.nodes if n.target is hops.local_map_hop)
    spec = node.args[-1]
    first = alternatives[0]
    node.args = (
        *node.args[:-1],
        SpecWithAlternatives(spec.mesh, first.in_placements, first.out_placements, first.in_grad_placements, alternatives),
    )
    return gm


class TestRegionAlternatives(TestCase):
    def test_the_solver_chooses_the_alternative_its_neighbours_want_and_apply_switches_to_it(self):
        gm = traced_with_alternatives(
            Alternative(ROWS_ON_DATA, ROWS_ON_DATA), Alternative(ROWS_ON_MODEL, ROWS_ON_MODEL)
        )
        x = torch.randn(64, 64)
        expected = program(x)
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        self.assertEqual(solution.region_choice("hops_local_map"), 1)
        self.assertEqual(solution.placements["getitem"], ROWS_ON_MODEL[0])
        passes.apply_placements(gm, solution)
        node = next(n for n in gm.graph.nodes if n.target is hops.local_map_hop)
        self.assertEqual(node.args[-1].in_placements, ROWS_ON_MODEL)
        passes.check_placements(gm)
        self.assertEqual(gm(x), expected)
        self.assertIn("alternative 1 of 2", passes.format_placements(gm, solution))

    def test_with_the_layouts_equal_the_cost_hint_decides(self):
        for cheap in (0, 1):
            hints = [1.0, 1.0]
            hints[cheap] = 1e-6
            gm = traced_with_alternatives(
                Alternative(ROWS_ON_MODEL, ROWS_ON_MODEL, cost_hint=hints[0]),
                Alternative(ROWS_ON_MODEL, ROWS_ON_MODEL, cost_hint=hints[1]),
            )
            solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
            self.assertEqual(solution.region_choice("hops_local_map"), cheap)

    def test_a_region_without_alternatives_is_fixed(self):
        gm = make_fx(program)(torch.randn(64, 64))
        solution = passes.solve_placements(gm, GRID, cost_model=SLOW_LINK)
        self.assertEqual(solution.region_choice("hops_local_map"), 0)
        self.assertEqual(solution.strategies["hops_local_map"].inputs, ROWS_ON_DATA)


if __name__ == "__main__":
    pytest.main([__file__])
