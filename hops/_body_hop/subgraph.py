"""Helpers for HOPs whose first argument is a body (a callable traced into a subgraph)."""

from __future__ import annotations

import operator
import types
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from hops._body_hop.body_record import update_record


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
    # Dynamo 2.9 answers a nested function's qualified name ("f.<locals>.g") for __name__.
    name = name.rpartition(".")[2]
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
    """``fn`` under the name ``name``, so the subgraph traced from it is named after the user
    function. A GraphModule stays reachable as its record's ``graph`` (``traced_graph``): a
    rule that needs the body's graph (a device rule staging it) can take it instead of
    tracing it again."""

    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    if isinstance(fn, fx.GraphModule):
        update_record(call, graph=fn)
    return call


def inline_graph(graph: fx.Graph, gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    """Copy ``gm``'s nodes into ``graph`` (whose owning module must hold ``gm``'s attributes)
    with its placeholders bound to ``inputs``; returns its flat outputs in ``graph``."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(inputs):
        raise ValueError(f"inline_graph: {len(placeholders)} placeholders, {len(inputs)} inputs")
    outputs = graph.graph_copy(gm.graph, dict(zip(placeholders, inputs)))
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def rename_inner_function(factory: Callable, inner: str, name: str) -> Callable:
    """A copy of ``factory`` whose nested function ``inner`` is compiled under ``name``.

    Tracers name subgraphs after the traced function's code name (Dynamo reads
    ``co_name``; an assigned ``__name__`` is not seen by every version), so a wrapper that
    defines its body inside traced code gets the user's function name this way.
    """
    if torch.compiler.is_dynamo_compiling():
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


def lift_tensor_constants(gm: fx.GraphModule) -> list[tuple[fx.Node, torch.Tensor]]:
    """Make each tensor constant of a traced body (what tracing makes of ``torch.tensor(...)``
    in it: a ``get_attr`` of a tensor) a trailing placeholder; return the new placeholders
    with the tensors, in order. The caller passes the tensors as operands, as if the body
    had closed over them: export lifts the constants of the top graph only, and its
    serializer refuses a tensor held by a subgraph."""
    constants = [
        node
        for node in gm.graph.find_nodes(op="get_attr")
        if isinstance(value := getattr(gm, node.target, None), torch.Tensor)
        and not isinstance(value, torch.nn.Parameter)
        and not value.requires_grad
    ]
    if not constants:
        return []
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    lifted = []
    for node in constants:
        value = getattr(gm, node.target)
        anchor = placeholders[-1] if placeholders else None
        with gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(next(iter(gm.graph.nodes))):
            placeholder = gm.graph.placeholder(node.target.lstrip("_") or "constant")
        placeholder.meta.update(node.meta)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
        placeholders.append(placeholder)
        lifted.append((placeholder, value))
    gm.recompile()
    return lifted


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (real or fake tensors)."""
    try:
        # _cdata identifies the StorageImpl (what StorageWeakRef compares), at a sixth of the cost.
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # tensors without accessible storage (XLA)
        return a is b


def fresh_outputs(outputs: Sequence[Any], inputs: Sequence[Any]) -> tuple:
    """``outputs`` with each tensor that aliases one of ``inputs`` or an earlier output
    replaced by a copy: a HOP's results are new tensors, whatever its body returns."""
    seen = [t for t in inputs if isinstance(t, torch.Tensor)]
    fresh = []
    for value in outputs:
        if isinstance(value, torch.Tensor):
            if any(shares_storage(value, t) for t in seen):
                value = value.clone()
            seen.append(value)
        fresh.append(value)
    return tuple(fresh)


def strip_detach(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop ``aten.detach`` nodes (``aten.alias`` on torch 2.15): value no-ops left behind by
    tracing a vjp."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
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


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value is a view of its first argument (by op schema; an element of
    a view op's list result counts too)."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and is_view(source)
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
            if is_view(node) and node.args and node.args[0] in root_of:
                root_of[node] = root_of[node.args[0]]
        elif node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            for position, value in enumerate(outputs):
                if isinstance(value, fx.Node) and value in root_of:
                    aliased.append((position, root_of[value]))
    return sorted(mutated), aliased


def clone_aliased_outputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Make no output of ``gm`` an input or a view of one: such an output becomes a ``clone``
    of it. A HOP's results never alias its operands, whatever its body returns
    (``return c, x.t()`` is a valid scan step). (An output returned twice needs no copy: a
    HOP makes a new tensor of each result.)"""
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0]
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    changed = False
    for position, value in enumerate(flat):
        if not isinstance(value, fx.Node):
            continue
        root = value
        while is_view(root) and isinstance(root.args[0], fx.Node):
            root = root.args[0]
        if root.op == "placeholder":
            with gm.graph.inserting_before(output):
                flat[position] = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
            changed = True
    if changed:
        output.args = (type(values)(flat) if isinstance(values, (tuple, list)) else flat[0],)
        gm.recompile()
    return gm


def refuse_untracked_xla_operands(mode: Any, operands: Sequence[Any], what: str) -> None:
    """A real-mode ``make_fx`` over XLA tensors sees them after torch_xla's functionalization
    unwrapped them: the tracer does not know them and would bake today's values into the
    graph as constants (plain ATen ops fare no better). Refused instead of a graph that
    silently ignores its inputs."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    for value in operands:
        if (
            isinstance(value, torch.Tensor)
            and value.device.type == "xla"
            and get_proxy_slot(value, mode.tracer, None) is None
        ):
            raise RuntimeError(
                f"{what}: make_fx in real mode does not track XLA tensors (torch_xla functionalizes them "
                "before the tracer sees them), so the graph would hold this call's values as constants; "
                "trace with make_fx(..., tracing_mode='fake') on CPU or fake tensors, or torch.compile"
            )


def symbolic_trace_call(hop: Any, args: Sequence[Any]) -> Any:
    """``hop(*args)`` under torch.fx symbolic tracing (how a pickled GraphModule is rebuilt):
    one node, or ``None`` when no argument is an ``fx.Proxy``."""
    for value in args:
        if isinstance(value, fx.Proxy):
            return value.tracer.create_proxy("call_function", hop, tuple(args), {})
    return None
