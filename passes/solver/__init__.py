"""The solver pipeline: place every value of a traced program on a device mesh.

- ``placement_graph``: the networkx view (values, strategies, fixed placements, data edges);
- ``solve_placements``: the cheapest placements under a ``CostModel`` and a memory budget;
- ``apply_placements``: the solution stated as sharding annotations and region choices;
- ``format_placements`` / ``draw_placements``: the solution printed / pictured;
- ``StrategyProblem`` / ``solve_problem``: the one solver core, as a plain problem (strategies,
  pair costs, memory over liveness intervals) that ``solve_placements`` builds from the graph
  and ``read_iopddl`` / ``write_iopddl`` read and write in the IOPDDL contest's format.
"""

from passes.solver.apply import apply_placements
from passes.solver.cost import PRESETS, CostModel
from passes.solver.draw import draw_placements
from passes.solver.format import format_placements
from passes.solver.graph import NodeKind, Strategy, UseKind, placement_graph
from passes.solver.iopddl import read_iopddl, write_iopddl
from passes.solver.problem import (
    InfeasiblePlacementError,
    NoPlanFoundError,
    ProblemSolution,
    StrategyProblem,
    peak_usage,
    problem_cost,
)
from passes.solver.search import solve_problem
from passes.solver.solve import PlacementSolution, solve_placements

__all__ = [
    "placement_graph",
    "solve_placements",
    "apply_placements",
    "format_placements",
    "draw_placements",
    "PlacementSolution",
    "Strategy",
    "NodeKind",
    "UseKind",
    "CostModel",
    "PRESETS",
    "InfeasiblePlacementError",
    "NoPlanFoundError",
    "StrategyProblem",
    "ProblemSolution",
    "solve_problem",
    "problem_cost",
    "peak_usage",
    "read_iopddl",
    "write_iopddl",
]
