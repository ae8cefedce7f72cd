"""Dynamo support for this package's HOPs: a VariableTracker per HOP.

A HOP without subgraphs is traced like any op: tensor arguments become proxies and spec
arguments become Python constants baked into the node (Dynamo guards them through their
source, so a different spec recompiles instead of silently reusing the graph).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hops import _compat


def _constant_or_proxy(tx: Any, arg: Any, hop_name: str, position: Any) -> Any:
    from torch._dynamo.variables.tensor import TensorVariable

    if isinstance(arg, TensorVariable):
        return arg.as_proxy()
    try:
        return arg.as_python_constant()
    except NotImplementedError:
        pass
    # Dynamo models our frozen spec dataclasses as user objects that still hold the value.
    value_type = arg.python_type()
    if dataclasses.is_dataclass(value_type) and hasattr(value_type, "__fx_create_arg__"):
        if arg.source is not None:
            _guard_on_value(arg.source, arg.value)
            return arg.value
        # Built inside the traced code: the fields live in Dynamo's side-effect tracking.
        return _rebuild_in_trace(tx, arg)
    _compat.dynamo_graph_break(
        gb_type=f"{hop_name}: non-constant argument",
        context=f"argument {position}: {arg}",
        explanation=f"{hop_name} takes tensors and constant spec values only",
    )


_PRIMITIVES = (int, float, bool, str, type(None))


def _rebuild_in_trace(tx: Any, arg: Any) -> Any:
    from torch._dynamo.variables.lists import BaseListVariable

    if isinstance(arg, BaseListVariable):
        return tuple(_rebuild_in_trace(tx, item) for item in arg.items)
    value_type = arg.python_type()
    if dataclasses.is_dataclass(value_type):
        fields = [f.name for f in dataclasses.fields(value_type) if f.init]
        return value_type(**{f: _rebuild_in_trace(tx, arg.var_getattr(tx, f)) for f in fields})
    return arg.as_python_constant()


def _guard_on_value(source: Any, value: Any) -> None:
    """Guard that the object at ``source`` still equals ``value`` (a spec value).

    EQUALS_MATCH accepts only builtin types, and ID_MATCH would recompile for every equal
    spec built anew; a spec is a tree of frozen dataclasses, tuples and primitives, so guard
    the type of each object and the equality of each primitive leaf.
    """
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, GetItemSource

    if isinstance(value, _PRIMITIVES) or (
        type(value) is tuple and all(isinstance(v, _PRIMITIVES) for v in value)
    ):
        install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))
        return
    install_guard(source.make_guard(GuardBuilder.TYPE_MATCH))
    if type(value) is tuple:
        install_guard(source.make_guard(GuardBuilder.SEQUENCE_LENGTH))
        for index, item in enumerate(value):
            _guard_on_value(GetItemSource(source, index), item)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            _guard_on_value(AttrSource(source, field.name), getattr(value, field.name))
    else:
        raise TypeError(f"cannot guard on {type(value).__name__} at {source.name()}")


def register_plain_hop(hop: Any) -> None:
    """Register a subgraph-free HOP with Dynamo; ``hop.node_args`` canonicalizes args."""
    base = _compat.dynamo_hop_variable_base()

    def _call_function(self: Any, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        from torch._dynamo.variables.builder import wrap_fx_proxy
        from torch._dynamo.variables.lazy import LazyVariableTracker

        args, kwargs = LazyVariableTracker.realize_all((args, kwargs))
        values = [_constant_or_proxy(tx, a, hop.__name__, i) for i, a in enumerate(args)]
        named = {k: _constant_or_proxy(tx, v, hop.__name__, k) for k, v in kwargs.items()}
        proxy = tx.output.create_proxy(
            "call_function", hop, hop.node_args(*values, **named), {}
        )
        return wrap_fx_proxy(tx=tx, proxy=proxy)

    variable_cls = type(
        f"{type(hop).__name__}Variable",
        (base,),
        {
            "_HOP_NAME": f"torch.ops.higher_order.{hop.__name__}",
            "_ALLOW_FALLBACK_TO_EAGER": True,
            "_call_function": _call_function,
        },
    )
    _compat.register_dynamo_hop_variable(hop, variable_cls)
