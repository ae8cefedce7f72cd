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
  its body (for backends without loops); other HOPs are kept;
- ``lower_to_jax`` (target ``"jax"``, ``passes/jax/``): a graph -> a JAX function of its inputs
  (annotations -> ``with_sharding_constraint``, regions -> ``shard_map``, a scan -> ``lax.scan``;
  ATen ops by a table of its own); needs jax (the ``jax`` extra), imported when it first runs.

The sharding solver (``passes/solver/``): ``placement_graph``, ``solve_placements``,
``apply_placements``, ``format_placements``, ``draw_placements``.

``check_placements`` verifies that stated layouts (annotations, region outputs) agree with
each local_map region's.
"""

import importlib
from typing import Any

import hops  # noqa: F401  (registers the HOPs the rule tables refer to)

# The XLA target registers the HOPs' device rules for XLA tensors (and how ``hops.assume_pure``
# runs there): ``hops`` imports it when it first meets an XLA tensor (the
# ``hops.device_targets`` entry point, ``passes.xla``; entry points installed by earlier
# versions name this package itself, so it is imported here too). Nothing else is imported
# until it is used: the solver (networkx, scipy) and the other targets load on first access.
from passes import xla  # noqa: F401

# public name -> the module defining it
_LAZY = {
    **dict.fromkeys(["RULES", "HopRulePass", "PassError", "graph_modules", "keep", "refuse", "register_rule", "rule_for"], "passes._infra"),
    "check_placements": "passes.check",
    **dict.fromkeys(["collective_counts", "lower_to_dtensor"], "passes.dtensor"),
    **dict.fromkeys(["inline_hops", "run_scan_loop"], "passes.inline"),
    **dict.fromkeys(
        [
            "CostModel",
            "InfeasiblePlacementError",
            "PlacementSolution",
            "apply_placements",
            "draw_placements",
            "format_placements",
            "placement_graph",
            "solve_placements",
        ],
        "passes.solver",
    ),
    "unroll_scan": "passes.unroll",
    "lower_to_jax": "passes.jax",
    **dict.fromkeys(["lower_to_xla", "run_in_named_scope", "run_scan"], "passes.xla"),
}
# Every target's rule table: the registry's names are complete once these are imported.
_TARGETS = ("passes.inline", "passes.xla", "passes.dtensor", "passes.unroll", "passes.jax")
_SUBMODULES = frozenset({"backends", "check", "dtensor", "inline", "jax", "solver", "unroll", "xla"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"passes.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'passes' has no attribute {name!r}")
    if module == "passes._infra":  # the registry, as ``import passes`` shows it: every target's rules
        for target in _TARGETS:
            importlib.import_module(target)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "inline_hops",
    "lower_to_xla",
    "lower_to_dtensor",
    "collective_counts",
    "unroll_scan",
    "lower_to_jax",
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
