"""``lower_to_xla``: rewrite this package's HOPs into the functional ``hops_xla`` ops.

One rule per HOP (``XLA_RULES``); a new HOP registers its rule with
``@register_xla_rule(hop)``. The lowered GraphModule runs on XLA tensors under SPMD, where
each op emits its custom call and XLA's partitioner (GSPMD) distributes the program; on
other devices the ops are identities, so the graph still runs (e.g. for testing).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._C import DispatchKey

from hops._base import flat_body
from hops._subgraph import body_name, clone_aliased_outputs
from hops.local_map import local_map_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, ShardingSpec
from passes import xla_ops
from passes._infra import HopRulePass, PassError, Rule, replace_tuple_output

XLA_RULES: dict[object, Rule] = {}


def register_xla_rule(hop: object):
    def register(rule: Rule) -> Rule:
        XLA_RULES[hop] = rule
        return rule

    return register


def _spec_text(node: fx.Node, spec: object) -> str:
    if not isinstance(spec, ShardingSpec):
        raise PassError(
            f"lower_to_xla: {node.format_node()}: the spec must be a hops.ShardingSpec, got {type(spec).__name__}"
        )
    for what, layout in (("its value", spec.layout), ("its gradient", spec.grad.layout)):
        if layout.has_partial:
            raise PassError(
                f"lower_to_xla: {node.format_node()}: {spec!r} lays out {what} with a Partial placement; "
                "an XLA sharding describes a whole value, so a sharding annotation cannot be Partial"
            )
    return repr(spec)


@register_xla_rule(sharding_annotation_hop)
def lower_sharding_annotation_to_xla(node: fx.Node) -> None:
    x, spec = node.args
    text = _spec_text(node, spec)
    # Rewriting the node in place keeps its name and stack trace.
    node.target = xla_ops.sharding_constraint
    node.args = (x, text)


@register_xla_rule(local_map_hop)
def lower_local_map_to_xla(node: fx.Node) -> None:
    """A manual-sharding region: enter each input per its placements, run the body on local
    tensors (the body stays a subgraph, lowered in turn), leave each output per its placements."""
    _, *inputs, spec = node.args
    if not isinstance(spec, LocalMapSpec):
        raise PassError(f"lower_to_xla: {node.format_node()}: last argument must be a hops.LocalMapSpec")
    graph = node.graph
    body = node.args[0]
    with graph.inserting_before(node):
        local_inputs = [
            value if placements is None
            else graph.call_function(xla_ops.enter_manual, (value, repr(ShardingSpec(spec.mesh, placements))))
            for value, placements in zip(inputs, spec.in_placements)
        ]
        local_outputs = graph.call_module(body.target, tuple(local_inputs))
        outputs = [
            graph.call_function(
                xla_ops.exit_manual,
                (graph.call_function(operator.getitem, (local_outputs, j)), repr(ShardingSpec(spec.mesh, placements))),
            )
            for j, placements in enumerate(spec.out_placements)
        ]
    replace_tuple_output(node, outputs)


def lower_to_xla(gm: fx.GraphModule) -> fx.GraphModule:
    """Lower every HOP of this package in ``gm`` and its subgraphs (in place); return ``gm``."""
    HopRulePass("lower_to_xla", XLA_RULES)(gm)
    return gm


# --------------------------------------------------------------------------- eager rules on XLA
#
# A HOP called on XLA tensors outside any tracer (how torch_xla programs run) dispatches to
# these rules, registered when this target is imported (hops loads it on the first XLA tensor
# it meets, see hops/_targets.py). Under SPMD they emit what the lowering emits.


def _spmd() -> bool:
    from torch_xla import runtime

    return runtime.is_spmd()


@sharding_annotation_hop.py_impl(DispatchKey.XLA)
def annotate_on_xla(x: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
    """The result carries the sharding, as after ``xs.mark_sharding`` (without SPMD there is
    no sharding to state: a copy)."""
    if not _spmd():
        return x.clone()
    if spec.has_partial:
        raise ValueError(
            f"annotate_sharding on XLA: {spec!r} has a Partial placement; an XLA sharding describes a "
            "whole value, so an annotation cannot be Partial"
        )
    return xla_ops.sharding_constraint_on_xla(x, repr(spec))


@local_map_hop.py_impl(DispatchKey.XLA)
def run_local_map_on_xla(body, *tensors_and_spec):
    """Under SPMD, a manual-sharding region (the body traced on local shapes and lowered);
    without SPMD, the eager simulation."""
    from passes.scan_rules import view_free_graph

    tensors, spec = local_map_hop.split_args(tensors_and_spec)
    if not _spmd():
        return local_map_hop.run(body, tensors, spec)
    check_mesh_fits_xla(spec.mesh, f"local_map {body_name(body)}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    examples = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in tensors]
    with mode:
        local_examples = local_map_hop.body_inputs(examples, spec)
    step = view_free_graph(body, local_examples)
    lower_to_xla(step)
    local = [
        value if placements is None else xla_ops.enter_manual(value, repr(ShardingSpec(spec.mesh, placements)))
        for value, placements in zip(tensors, spec.in_placements)
    ]
    outputs = step(*local)
    return tuple(
        xla_ops.exit_manual(output, repr(ShardingSpec(spec.mesh, placements)))
        for output, placements in zip(outputs, spec.out_placements)
    )


def check_mesh_fits_xla(mesh: Any, what: str) -> None:
    """``PassError`` unless ``mesh``'s device ids are the XLA devices of this process."""
    from torch_xla import runtime

    count = runtime.global_runtime_device_count()
    if sorted(mesh.device_ids) != list(range(count)):
        raise PassError(
            f"{what}: its mesh {mesh!r} has devices {sorted(mesh.device_ids)}, but this process has "
            f"{count} XLA devices (0..{count - 1}); an XLA mesh must use each device once"
        )
