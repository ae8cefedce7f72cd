"""Inline and XLA rules for kernel calls (``hops.kernel``), einsum and named scopes.

Kernels are defined by user code after this module is imported, so each kernel registers
its rules when it is defined (``on_kernel_defined`` in ``hops/kernel.py``):
- inline: the node becomes a call of the kernel's implementation (a plain function any
  backend can run or trace through);
- XLA: the node becomes a call of the kernel's XLA implementation when it has one, else of
  its implementation, run on XLA tensors.
The built-in einsum kernels have their own rules: they become ``aten.einsum`` (plus
``aten.add`` for the bias), which torch_xla compiles to one ``dot`` that keeps batch dims.

A named scope inlines into its body; lowered to XLA, its body runs inside torch_xla's
op-name scope (``run_in_named_scope``), so the region's HLO ops carry the name in their
``op_name`` metadata.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from hops.einsum import einsum_kernel, einsum_linear_kernel
from hops.kernel import Kernel, KernelParams, on_kernel_defined
from hops.named_scope import ScopeSpec, named_scope_hop, run_in_scope
from passes._infra import PassError, body_module, copy_body_into, replace_tuple_output
from passes.inline import inline_hops, register_inline_rule
from passes.xla import register_xla_rule

__all__ = ["run_in_named_scope"]


def _kernel_call(node: fx.Node) -> tuple[Kernel, tuple[Any, ...], KernelParams]:
    kernel_hop = node.target
    *tensors, params = node.args
    if not isinstance(params, KernelParams):
        raise PassError(
            f"{node.format_node()}: the last argument of a kernel call must be a hops.KernelParams, "
            f"got {type(params).__name__}"
        )
    return kernel_hop, tuple(tensors), params


def _call_function_rule(choose: Callable[[Kernel], Callable]) -> Callable[[fx.Node], None]:
    def rule(node: fx.Node) -> None:
        kernel_hop, tensors, params = _kernel_call(node)
        # Rewritten in place: the node keeps its name, users and stack trace.
        node.target = choose(kernel_hop)
        node.args = tensors
        node.kwargs = params.as_dict()

    return rule


inline_kernel = _call_function_rule(lambda k: k.implementation)
lower_kernel_to_xla = _call_function_rule(lambda k: k.xla_implementation or k.implementation)


def _register_kernel_rules(kernel_hop: Kernel) -> None:
    if kernel_hop in (einsum_kernel, einsum_linear_kernel):
        return  # their own rules, below
    register_inline_rule(kernel_hop)(inline_kernel)
    register_xla_rule(kernel_hop)(lower_kernel_to_xla)


on_kernel_defined(_register_kernel_rules)


# --------------------------------------------------------------------------- einsum


@register_inline_rule(einsum_kernel)
@register_xla_rule(einsum_kernel)
def einsum_to_aten(node: fx.Node) -> None:
    _, operands, params = _kernel_call(node)
    node.target = torch.ops.aten.einsum.default
    node.args = (params.as_dict()["equation"], list(operands))
    node.kwargs = {}


@register_inline_rule(einsum_linear_kernel)
@register_xla_rule(einsum_linear_kernel)
def einsum_linear_to_aten(node: fx.Node) -> None:
    _, (x, weight, bias), _ = _kernel_call(node)
    with node.graph.inserting_before(node):
        product = node.graph.call_function(torch.ops.aten.einsum.default, ("...i,oi->...o", [x, weight]))
    node.target = torch.ops.aten.add.Tensor
    node.args = (product, bias)
    node.kwargs = {}


# --------------------------------------------------------------------------- named scopes


def _scope_call(node: fx.Node) -> tuple[fx.GraphModule, list[Any], ScopeSpec]:
    *inputs, spec = node.args[1:]
    if not isinstance(spec, ScopeSpec):
        raise PassError(f"{node.format_node()}: the last argument must be a hops.ScopeSpec, got {type(spec).__name__}")
    return body_module(node), inputs, spec


@register_inline_rule(named_scope_hop)
def inline_named_scope(node: fx.Node) -> None:
    body, inputs, _ = _scope_call(node)
    # The pass visits a graph before the bodies nested in it: inline this body's own HOPs
    # first, so that what is copied up is plain ATen.
    inline_hops(body)
    (output,) = body.graph.find_nodes(op="output")
    outputs = copy_body_into(node, body, inputs)
    if isinstance(output.args[0], (tuple, list)):
        replace_tuple_output(node, outputs)
        return
    # A region returning one tensor: the node's users read it directly.
    body_attr = node.args[0]
    node.replace_all_uses_with(outputs[0])
    node.graph.erase_node(node)
    if isinstance(body_attr, fx.Node) and body_attr.op == "get_attr" and not body_attr.users:
        node.graph.erase_node(body_attr)


def run_in_named_scope(body: Callable, *inputs_and_spec: Any) -> Any:
    """``body(*inputs)`` inside the op-name scope ``spec.name`` (on XLA tensors; elsewhere
    just the body): what a lowered named scope calls."""
    *inputs, spec = inputs_and_spec
    return run_in_scope(body, inputs, spec)


@register_xla_rule(named_scope_hop)
def lower_named_scope_to_xla(node: fx.Node) -> None:
    """The body stays a subgraph (lowered in turn) and runs inside torch_xla's op-name scope."""
    _scope_call(node)
    node.target = run_in_named_scope
