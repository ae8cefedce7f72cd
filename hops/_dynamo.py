"""Dynamo support for this package's HOPs: a VariableTracker per HOP.

A HOP without subgraphs is traced like any op: tensor arguments become proxies and spec
arguments become Python constants baked into the node (Dynamo guards them through their
source, so a different spec recompiles instead of silently reusing the graph).
"""

from __future__ import annotations

from typing import Any

import torch

from hops import _compat


def _constant_or_proxy(arg: Any, hop_name: str, position: int) -> Any:
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables.tensor import TensorVariable

    if isinstance(arg, TensorVariable):
        return arg.as_proxy()
    try:
        return arg.as_python_constant()
    except NotImplementedError:
        pass
    # Values Dynamo models as user objects still hold the real object; ours are immutable.
    value = getattr(arg, "value", None)
    if value is not None and hasattr(type(value), "__fx_create_arg__"):
        return value
    unimplemented_args: dict[str, Any] = dict(
        gb_type=f"{hop_name}: non-constant argument",
        context=f"argument {position}: {arg}",
        explanation=f"{hop_name} takes tensors and constant spec values only",
        hints=[],
    )
    try:
        unimplemented(**unimplemented_args)
    except TypeError:  # older signature: a single message
        unimplemented(unimplemented_args["explanation"])
    raise AssertionError("unreachable")


def register_plain_hop(hop: Any) -> None:
    """Register a subgraph-free HOP with Dynamo; ``hop.node_args`` canonicalizes args."""
    base = _compat.dynamo_hop_variable_base()

    def _call_function(self: Any, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        from torch._dynamo.variables.builder import wrap_fx_proxy
        from torch._dynamo.variables.lazy import LazyVariableTracker

        args, kwargs = LazyVariableTracker.realize_all((args, kwargs))
        values = [_constant_or_proxy(a, hop.__name__, i) for i, a in enumerate(args)]
        named = {k: _constant_or_proxy(v, hop.__name__, k) for k, v in kwargs.items()}
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
