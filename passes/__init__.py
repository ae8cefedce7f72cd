"""FX passes over graphs that contain this package's HOPs.

- ``inline_hops``: HOPs -> plain ATen graph any backend runs.
- ``lower_to_xla``: HOPs -> functional ``hops_xla`` ops whose XLA kernels emit sharding custom calls.
- ``unroll_scan``: a scan -> ``length`` copies of its body (for backends without loops).
- ``check_placements``: stated layouts (annotations, region outputs) agree with each local_map region.
"""

import hops  # noqa: F401  (registers the HOPs the rule tables refer to)
from passes.inline import INLINE_RULES, inline_hops, register_inline_rule
from passes.xla import XLA_RULES, lower_to_xla, register_xla_rule
from passes._infra import HopRulePass, PassError, graph_modules
from passes.check import check_placements
from passes import kernel_rules  # noqa: F401,E402  (registers rules for kernels, einsum, named scopes)
from passes.scan_rules import run_scan, unroll_scan
from passes.solver import CostModel, InfeasiblePlacementError, PlacementSolution, apply_placements, draw_placements, format_placements, placement_graph, solve_placements  # noqa: E402

__all__ = [
    "inline_hops",
    "lower_to_xla",
    "check_placements",
    "unroll_scan",
    "run_scan",
    "INLINE_RULES",
    "XLA_RULES",
    "register_inline_rule",
    "register_xla_rule",
    "HopRulePass",
    "PassError",
    "graph_modules",
    "placement_graph",
    "solve_placements",
    "apply_placements",
    "format_placements",
    "draw_placements",
    "PlacementSolution",
    "CostModel",
    "InfeasiblePlacementError",
]
