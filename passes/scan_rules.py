"""Scan lowerings: ``lower_to_xla`` makes a scan one XLA ``While``; ``unroll_scan`` unrolls it.

``lower_to_xla`` retargets a scan node to ``run_scan`` with the same args: the body stays a
subgraph (lowered in turn, so its annotations and regions become custom calls inside the
loop). On XLA tensors ``run_scan`` is ``passes.xla_while``: the body staged once per input
layout into an XLA computation called from a ``While`` loop; elsewhere it runs the steps
eagerly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from hops.scan import ScanSpec, _length, _run_steps, _split, scan_hop
from passes._infra import HopRulePass, PassError, body_module, copy_body_into, replace_tuple_output
from passes.xla import register_xla_rule
from passes.xla_while import xla_while


def run_scan(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """The lowered scan: one XLA ``While`` on XLA tensors, a Python loop elsewhere."""
    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    if not any(t.device.type == "xla" for t in inputs if isinstance(t, torch.Tensor)):
        return _run_steps(body, inputs, spec)
    return xla_while(body, carry, xs, additional, length=_length(xs, spec), reverse=spec.reverse)


@register_xla_rule(scan_hop)
def lower_scan_to_xla(node: fx.Node) -> None:
    if not isinstance(node.args[-1], ScanSpec):
        raise PassError(f"lower_to_xla: {node.format_node()}: last argument must be a hops.ScanSpec")
    # Same args: the body subgraph is lowered in place by the same pass.
    node.target = run_scan


def _unroll(node: fx.Node) -> None:
    spec = node.args[-1]
    if spec.length is None:
        raise PassError(
            f"unroll_scan: {node.format_node()} has a symbolic length; unrolling needs a static one "
            "(trace with static shapes, or keep the scan and run it with its eager rule)"
        )
    if spec.length == 0:
        raise PassError(f"unroll_scan: {node.format_node()} has length 0; nothing to unroll (keep the scan)")
    graph = node.graph
    body = body_module(node)
    carry, xs, additional = _split(node.args[1:-1], spec)
    ys_per_step: list[Any] = [None] * spec.length
    order = range(spec.length - 1, -1, -1) if spec.reverse else range(spec.length)
    for i in order:
        with graph.inserting_before(node):
            x = [graph.call_function(torch.ops.aten.select.int, (value, 0, i)) for value in xs]
        outputs = copy_body_into(node, body, [*carry, *x, *additional])
        carry, ys_per_step[i] = outputs[: spec.num_carry], outputs[spec.num_carry :]
    with graph.inserting_before(node):
        ys = [
            graph.call_function(torch.ops.aten.stack.default, ([step[j] for step in ys_per_step],))
            for j in range(len(ys_per_step[0]))
        ]
    replace_tuple_output(node, [*carry, *ys])


def unroll_scan(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every scan (in ``gm`` and its subgraphs) by ``length`` copies of its body."""
    HopRulePass("unroll_scan", {scan_hop: _unroll})(gm)
    return gm
