"""Scan lowerings: ``lower_to_xla`` makes a scan one XLA ``While``; ``unroll_scan`` unrolls it.

``lower_to_xla`` retargets a scan node to ``run_scan`` with the same args: the body stays a
subgraph (lowered in turn, so its annotations and regions become custom calls inside the
loop). On XLA tensors ``run_scan`` stages the body once into an XLA computation and calls
it from a ``While`` loop; elsewhere it runs the steps eagerly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from hops.scan import ScanSpec, _run_steps, _split, scan_hop
from passes._infra import HopRulePass, PassError, body_module, copy_body_into, replace_tuple_output
from passes.xla import register_xla_rule


def run_scan(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """The lowered scan: one XLA ``While`` on XLA tensors, a Python loop elsewhere."""
    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    if not any(t.device.type == "xla" for t in inputs if isinstance(t, torch.Tensor)):
        return _run_steps(body, inputs, spec)
    return _xla_while(body, carry, xs, additional, spec)


def _xla_while(body: Callable, carry: list, xs: list, additional: list, spec: ScanSpec) -> tuple:
    # torch_xla stages a (carry, x) -> (carry, y) function on placeholder tensors into one
    # computation and loops it in a While (tensors the function reads besides its
    # arguments, here the additional inputs, become loop parameters). It is private API of
    # torch_xla 2.9's experimental scan; its public scan also differentiates the body,
    # which a lowered forward or backward graph must not do.
    from torch_xla.experimental.scan import _scan_impl_flat

    num_carry = len(carry)
    if not xs:
        # A scan with only a length: loop over an empty-feature counter.
        xs = [torch.zeros((spec.length, 0), device=carry[0].device if carry else "xla")]
        num_xs = 0
    else:
        num_xs = len(xs)

    def step(carry_values: list, x_values: list) -> tuple[list, list]:
        outputs = body(*carry_values, *x_values[:num_xs], *additional)
        return list(outputs[:num_carry]), list(outputs[num_carry:])

    new_carry, ys = _scan_impl_flat(step, list(carry), list(xs), reverse=spec.reverse)
    return (*new_carry, *ys)


def _contains_region(body: fx.GraphModule) -> bool:
    from hops.local_map import local_map_hop

    return any(
        node.op == "call_function" and node.target is local_map_hop
        for module in body.modules()
        if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes
    )


@register_xla_rule(scan_hop)
def lower_scan_to_xla(node: fx.Node) -> None:
    if not isinstance(node.args[-1], ScanSpec):
        raise PassError(f"lower_to_xla: {node.format_node()}: last argument must be a hops.ScanSpec")
    if _contains_region(body_module(node)):
        # torch_xla 2.9's SPMD partitioner aborts the process (hlo_sharding.cc "Check failed:
        # !IsManual()") on a manual-sharding region inside a While body, even with nothing
        # manual crossing the loop boundary; its own enable/disable_manual_sharding do too.
        raise PassError(
            f"lower_to_xla: {node.format_node()} has a local_map region in its body; torch_xla 2.9 "
            "aborts on manual-sharding regions inside an XLA While. Unroll it first "
            "(passes.unroll_scan), or keep the region outside the scan"
        )
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
