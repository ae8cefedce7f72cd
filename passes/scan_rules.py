"""Scan lowerings: ``lower_to_xla`` makes a scan one XLA ``While``; ``unroll_scan`` unrolls it.

``lower_to_xla`` retargets a scan node to ``run_scan`` with the same args: the body stays a
subgraph (lowered in turn, so its annotations and regions become custom calls inside the
loop). On XLA tensors ``run_scan`` is ``passes.xla_while``: the body staged once per input
layout into an XLA computation called from a ``While`` loop; elsewhere it runs the steps
eagerly.

``run_scan_on_xla`` is the scan's eager rule on XLA tensors (``hops.scan`` called on them,
forward and backward): the body is traced, lowered like a subgraph, and run by the same
``While``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from torch._C import DispatchKey

from hops._base import flat_body
from hops._subgraph import _is_view as is_view
from hops._subgraph import body_name, clone_aliased_outputs
from hops.local_map import local_map_hop
from hops.scan import ScanSpec, _length, _run_steps, _slice_examples, _split, scan_hop
from passes._infra import HopRulePass, PassError, body_module, copy_body_into, graph_modules, replace_tuple_output
from passes.xla import register_xla_rule
from passes.xla_while import xla_while


def run_scan(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """The lowered scan: one XLA ``While`` on XLA tensors, a Python loop elsewhere."""
    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    if not any(t.device.type == "xla" for t in inputs if isinstance(t, torch.Tensor)):
        return _run_steps(body, inputs, spec)
    return xla_while(body, carry, xs, additional, length=_length(xs, spec), reverse=spec.reverse)


def view_free_graph(body: Callable, examples: list) -> fx.GraphModule:
    """``body`` traced on fake ``examples`` into a graph without view ops or aliased outputs.

    Device rules run below functionalization, where torch_xla computes views of its tensors
    wrongly: each view op becomes its ``*_copy`` op (as ``functionalize(remove=
    "mutations_and_views")`` would; the body is already functionalized). An output that is an
    input (``return c, y``) becomes a copy: a staged step must compute each loop output."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = clone_aliased_outputs(make_fx(flat_body(body), tracing_mode="fake")(*examples))
    for module in graph_modules(graph):
        changed = False
        for node in module.graph.nodes:
            if node.op == "call_function" and is_view(node) and isinstance(node.target, torch._ops.OpOverload):
                packet = getattr(torch.ops.aten, f"{node.target.overloadpacket.__name__}_copy", None)
                copy = getattr(packet, node.target._overloadname, None) if packet is not None else None
                if copy is not None:
                    node.target, changed = copy, True
        if changed:
            module.recompile()
    return graph


def run_scan_on_xla(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """A scan called eagerly on XLA tensors, as one XLA ``While``.

    ``body`` is traced on fake tensors (the HOPs it calls stay nodes), lowered by
    ``lower_to_xla`` under SPMD, and run by ``xla_while``. Without SPMD there is no sharding
    to lower: the HOPs run their eager rules inside the loop, except a ``local_map`` region,
    whose eager SPMD simulation compares device results by value, which a staged step has
    not got: it is refused. The body is traced on every call: it may read Python state that
    changes between calls, and XLA's own cache skips recompiling an unchanged loop.
    """
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_xla import runtime

    from passes.xla import lower_to_xla

    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    length = _length(xs, spec)
    if length == 0:  # nothing to loop over: the eager rule makes the empty ys
        return _run_steps(body, inputs, spec)
    step = view_free_graph(body, [*carry, *_slice_examples(xs), *additional])
    if runtime.is_spmd():
        lower_to_xla(step)
    elif any(node.target is local_map_hop for module in graph_modules(step) for node in module.graph.nodes):
        raise RuntimeError(
            f"scan({body_name(body)}): a local_map region in a scan on XLA tensors runs as a manual-sharding "
            "region, which needs SPMD: call torch_xla.runtime.use_spmd() first"
        )
    return xla_while(step, carry, xs, additional, length=length, reverse=spec.reverse)


# ``hops.scan`` called on XLA tensors: one While, not a Python loop that lazy tracing would
# unroll into ``length`` copies of the body. Registered by the XLA target, not by hops/.
scan_hop.py_impl(DispatchKey.XLA)(run_scan_on_xla)


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
