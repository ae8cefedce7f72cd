"""The solver pipeline: place every value of a traced program on a device mesh.

- ``placement_graph``: the networkx view (values, strategies, fixed placements, data edges);
- ``solve_placements``: the cheapest placements under a ``CostModel`` and a memory budget.
"""

from passes.solver.cost import PRESETS, CostModel
from passes.solver.graph import Strategy, placement_graph
from passes.solver.ilp import InfeasiblePlacementError
from passes.solver.solve import PlacementSolution, solve_placements

__all__ = [
    "placement_graph",
    "solve_placements",
    "PlacementSolution",
    "Strategy",
    "CostModel",
    "PRESETS",
    "InfeasiblePlacementError",
]
