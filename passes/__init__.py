"""FX passes over graphs that contain this package's HOPs.

Each lowering target is a table of rules, one per HOP (``passes/_infra.py``):

- ``inline_hops`` (target ``"inline"``, ``passes/inline.py``): HOPs -> plain ATen and
  ``torch.library`` ops any backend runs;
- ``lower_to_xla`` (target ``"xla"``, ``passes/xla/``): HOPs -> functional ``hops_xla`` ops
  whose XLA kernels emit sharding custom calls, a scan -> one XLA ``While``;
- ``lower_to_dtensor`` (target ``"dtensor"``, ``passes/dtensor/``): HOPs -> DTensor redistributions,
  ``local_map`` regions on local shards, a scan as a Python loop over DTensor steps; runs on
  real processes (``torch.distributed``);
- ``unroll_scan`` (target ``"unroll"``, ``passes/unroll.py``): a scan -> ``length`` copies of
  its body (for backends without loops); other HOPs are kept.

The sharding solver (``passes/solver/``): ``placement_graph``, ``solve_placements``,
``apply_placements``, ``format_placements``, ``draw_placements``.

``check_placements`` verifies that stated layouts (annotations, region outputs) agree with
each local_map region's.
"""

import hops  # noqa: F401  (registers the HOPs the rule tables refer to)
from passes._infra import RULES, HopRulePass, PassError, graph_modules, keep, refuse, register_rule, rule_for
from passes.check import check_placements
from passes.dtensor import collective_counts, lower_to_dtensor
from passes.inline import inline_hops, run_scan_loop
from passes.solver import (
    CostModel,
    InfeasiblePlacementError,
    PlacementSolution,
    apply_placements,
    draw_placements,
    format_placements,
    placement_graph,
    solve_placements,
)
from passes.unroll import unroll_scan
from passes.xla import lower_to_xla, run_in_named_scope, run_scan

__all__ = [
    "inline_hops",
    "lower_to_xla",
    "lower_to_dtensor",
    "collective_counts",
    "unroll_scan",
    "check_placements",
    "run_scan",
    "run_scan_loop",
    "run_in_named_scope",
    "RULES",
    "register_rule",
    "rule_for",
    "keep",
    "refuse",
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
