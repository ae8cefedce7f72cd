"""The XLA target: ``lower_to_xla`` (its rules, ``passes/xla/rules.py``), the functional ops
it lowers to (``ops.py``), the XLA ``While`` a scan runs as (``while_loop.py``), and the rules
HOPs run on XLA tensors outside any tracer (``eager.py``: an annotation shards, a region is
a manual-sharding region, a scan is one ``While``).

``hops`` imports this target when it first meets an XLA tensor (the ``hops.device_targets``
entry point), so eager torch_xla programs get those rules without importing ``passes``.
"""

from __future__ import annotations

import torch.fx as fx

from hops.lowering import register_graph_compiler
from passes._infra import HopRulePass
from passes.xla import eager, portable, rules  # noqa: F401  (register the target's and the device's rules)
from passes.xla.backend import XlaAutogradOrderError, lowered_and_staged, prepare_autograd_for_xla
from passes.xla.rules import run_in_named_scope, run_scan

# hops.assume_pure on XLA tensors: its graphs lowered and staged, as backend="hops_xla" does.
register_graph_compiler("xla", lowered_and_staged, prepare=prepare_autograd_for_xla)

__all__ = ["XlaAutogradOrderError", "lower_to_xla", "prepare_autograd_for_xla", "run_scan", "run_in_named_scope"]


def lower_to_xla(gm: fx.GraphModule) -> fx.GraphModule:
    """Lower every HOP of this package in ``gm`` and its subgraphs (in place); return ``gm``.
    Every tensor constant of ``gm`` and of its bodies, and every op recorded with the tracing
    host's ``device=cpu`` (factories, copies, export's metadata checks), is on the device its graph
    runs on (``rules.constants_to_graph_device``, ``rules.host_device_to_graph_device``); every op only
    the host runs (CPU flash attention) runs as ordinary ops, and a reduction given ``dim=[]`` reduces
    every dim as in torch (``portable.replace_non_portable_ops``)."""
    HopRulePass(rules.TARGET, name="lower_to_xla")(gm)
    rules.constants_to_graph_device(gm)
    rules.host_device_to_graph_device(gm)
    portable.replace_non_portable_ops(gm)
    return gm
