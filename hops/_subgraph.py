"""Helpers for HOPs whose first argument is a body (a callable traced into a subgraph)."""

from __future__ import annotations

import types
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx


def body_name(body: Any) -> str:
    """A Python identifier naming ``body`` after the user function it came from.

    Functions keep their ``__name__``; a GraphModule traced from one carries it as its class
    name (``make_fx`` names the class after the function), so re-tracing keeps the name.
    """
    # No regular expressions: this runs inside Dynamo-traced wrappers, and Dynamo 2.9 fails
    # tracing ``re`` when a pattern is not in its compile cache.
    name = getattr(body, "__name__", None)
    if not isinstance(name, str) or name in ("GraphModule", "forward"):
        name = type(body).__name__
    characters: list[str] = []
    for character in name:  # each run of non-word characters becomes one "_"
        if character.isalnum() or character == "_":
            characters.append(character)
        elif not characters or characters[-1] != "\0":
            characters.append("\0")
    name = "".join(characters).replace("\0", "_").strip("_") or "body"
    # A subgraph registered as "<fn>_body_<n>" and traced again keeps "<fn>".
    head, found, tail = name.rpartition("_body")
    if found and head and (tail == "" or tail.lstrip("_").isdigit() and not tail.startswith("__")):
        name = head
    if name == "GraphModule":
        name = "body"
    return name if not name[0].isdigit() else f"body_{name}"


def named(fn: Callable, name: str) -> Callable:
    """``fn`` under the name ``name``, so the subgraph traced from it is named after the user function."""

    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    return call


def rename_inner_function(factory: Callable, inner: str, name: str) -> Callable:
    """A copy of ``factory`` whose nested function ``inner`` is compiled under ``name``.

    Tracers name subgraphs after the traced function's code name (Dynamo reads
    ``co_name``; an assigned ``__name__`` is not seen by every version), so a wrapper that
    defines its body inside traced code gets the user's function name this way.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace code-object surgery; a wrapper built inside compiled code keeps
        # the generic name rather than breaking the graph.
        return factory
    code = factory.__code__
    consts = tuple(
        c.replace(co_name=name, co_qualname=name) if isinstance(c, types.CodeType) and c.co_name == inner else c
        for c in code.co_consts
    )
    renamed = types.FunctionType(
        code.replace(co_consts=consts), factory.__globals__, factory.__name__, factory.__defaults__, factory.__closure__
    )
    renamed.__kwdefaults__ = factory.__kwdefaults__
    return renamed


def strip_detach(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop ``aten.detach`` nodes: value no-ops left behind by tracing a vjp."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()
    return gm


def _is_mutating_use(node: fx.Node, value: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        given = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if given is value or (isinstance(given, (list, tuple)) and value in given):
            return True
    return False


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def find_input_mutation_and_aliasing(gm: fx.GraphModule) -> tuple[list[int], list[tuple[int, int]]]:
    """Inputs a traced body writes to, and (output, input) pairs where an output aliases an input.

    Reads op schemas: a write through any view of a placeholder counts as a mutation of it,
    and an output that is a placeholder or a view of one aliases it.
    """
    root_of: dict[fx.Node, int] = {}
    mutated: set[int] = set()
    aliased: list[tuple[int, int]] = []
    index = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root_of[node] = index
            index += 1
        elif node.op == "call_function":
            for value in node.all_input_nodes:
                if value in root_of and _is_mutating_use(node, value):
                    mutated.add(root_of[value])
            if _is_view(node) and node.args and node.args[0] in root_of:
                root_of[node] = root_of[node.args[0]]
        elif node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            for position, value in enumerate(outputs):
                if isinstance(value, fx.Node) and value in root_of:
                    aliased.append((position, root_of[value]))
    return sorted(mutated), aliased


def check_body_is_functional(
    gm: fx.GraphModule, function: str, input_names: Sequence[str] | None = None, num_outputs: int | None = None
) -> None:
    """``ValueError`` naming the function and argument if the body mutates or aliases an input.

    ``num_outputs`` limits the aliasing check to the first outputs (a joint graph's step
    outputs; its gradients may be a cotangent unchanged).
    """
    mutated, aliased = find_input_mutation_and_aliasing(gm)
    if num_outputs is not None:
        aliased = [(output, source) for output, source in aliased if output < num_outputs]

    def name(i: int) -> str:
        return input_names[i] if input_names is not None and i < len(input_names) else f"input {i}"

    if mutated:
        raise ValueError(
            f"{function} mutates its argument {name(mutated[0])} in place; a region body must be "
            "functional (return a new tensor instead of writing into an input)"
        )
    if aliased:
        output, source = aliased[0]
        raise ValueError(
            f"{function} returns output {output}, which aliases its argument {name(source)} (the input "
            "itself or a view of it); return a copy (e.g. .clone()) instead"
        )


def copy_if_aliases(outputs: Sequence[Any], inputs: Sequence[Any]) -> tuple:
    """``outputs`` with every tensor that aliases one of ``inputs`` (or an earlier output)
    replaced by a copy: a region's outputs must be new tensors (a vjp may return its
    cotangent unchanged)."""
    seen = [t for t in inputs if isinstance(t, torch.Tensor)]
    copied = []
    for value in outputs:
        if isinstance(value, torch.Tensor) and any(torch._C._is_alias_of(value, t) for t in seen):
            value = value.clone()
        if isinstance(value, torch.Tensor):
            seen.append(value)
        copied.append(value)
    return tuple(copied)


def emit_body_node(mode: Any, hop: Any, body: Callable, examples: Sequence[Any], args: Sequence[Any], outputs: Any) -> Any:
    """The proxy rule of a HOP with a body: trace ``body`` on ``examples`` into a subgraph
    named after the user function, refuse it if it mutates or aliases its inputs, and emit
    one node ``hop(subgraph, *args)`` whose result is ``outputs``: values computed by the
    caller with proxy tracing off, or a function of the traced subgraph that computes them
    (with proxy tracing off)."""
    import torch.utils._pytree as pytree
    from torch._higher_order_ops.utils import reenter_make_fx
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, track_tensor_tree

    name = body_name(body)
    body_graph = reenter_make_fx(body)(*examples)
    check_body_is_functional(body_graph, name)
    # make_fx names the class after the function it traced (a wrapper of ``body``):
    # re-tracing this graph, and errors raised from it, then name the user function.
    type(body_graph).__name__ = name
    qualname = mode.tracer.get_fresh_qualname(f"{name}_body_")
    mode.tracer.root.register_module(qualname, body_graph)
    if callable(outputs):
        with disable_proxy_modes_tracing():
            outputs = outputs(body_graph)
    node_args = pytree.tree_map(mode.tracer.unwrap_proxy, (body_graph, *args))
    out_proxy = mode.tracer.create_proxy("call_function", hop, node_args, {})
    return track_tensor_tree(outputs, out_proxy, constant=None, tracer=mode.tracer)


def known_functional(body: Callable) -> Callable:
    """Mark a body this package built from graphs already checked to be functional (e.g. a
    split joint): its functionalization rule need not trace it again to check it."""
    body.hops_known_functional = True
    return body


def functionalize_body_call(
    ctx: Any, hop: Any, body: Callable, inputs: Sequence[Any], trailing: Sequence[Any], examples_of: Callable
) -> Any:
    """The functionalization rule of a HOP ``hop(body, *inputs, *trailing)``.

    The body is refused if it writes into or returns its inputs (functionalizing it would
    silently drop the writes): it is traced once on ``examples_of(unwrapped inputs)``, what
    it really sees. Then the functionalized body (under the user function's name) runs
    one level down.
    """
    from torch._higher_order_ops.utils import _maybe_run_with_interpreter, materialize_as_graph
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    unwrapped = ctx.unwrap_tensors(list(inputs))
    if not getattr(body, "hops_known_functional", False):
        with disable_proxy_modes_tracing():
            examples = tuple(examples_of(unwrapped))
        check_body_is_functional(materialize_as_graph(body, examples), body_name(body))
    with ctx.redispatch_to_next():
        functional_body = named(ctx.functionalize(_maybe_run_with_interpreter(body)), body_name(body))
        outputs = hop(functional_body, *unwrapped, *trailing)
    return ctx.wrap_tensors(outputs)


def symbolic_trace_call(hop: Any, args: Sequence[Any]) -> Any:
    """``hop(*args)`` under torch.fx symbolic tracing (how a pickled GraphModule is rebuilt):
    one node, or ``None`` when no argument is an ``fx.Proxy``."""
    for value in args:
        if isinstance(value, fx.Proxy):
            return value.tracer.create_proxy("call_function", hop, tuple(args), {})
    return None
