"""A lowered graph as a JAX function: each node evaluated on ``jax.Array``s (or tracers).

``jax_function(gm)`` checks every node of ``gm`` once (an ATen op needs a rule in
``passes/jax/aten.py``, else ``NoJaxRule`` naming it, before anything runs) and returns a
function of the graph's inputs that evaluates the nodes in order: ATen ops by their rules, the
calls the HOP rules made (``passes/jax/rules.py``: functions of jax values that run their bodies
through ``jax_function`` in turn), tensor constants as jax arrays. Under ``jax.jit`` the nodes
are traced once; jax then sees only ``jnp`` / ``lax`` operations, so ``jax.grad``, ``jax.vjp``
and ``jax.jit(...).lower(...)`` work on it like on any JAX function.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.fx as fx

from hops.lowering import is_view
from passes._infra import PassError
from passes.jax.aten import rule_of

_FUNCTIONS: "weakref.WeakKeyDictionary[fx.GraphModule, Callable[..., Any]]" = weakref.WeakKeyDictionary()

# A function a HOP rule made the node's target (a runner on jax values): called as it is.
RUNNERS: set[Callable[..., Any]] = set()


class _Constant:
    """A tensor constant of the graph as a jax array, made when the function first runs: a
    backend lowers the graph while AOTAutograd's fake mode is active, where reading a real
    tensor's values is refused (a model's constant, OPT's empty ``tensor([])``). One array per
    x64 mode: a caller may run the function with and without ``jax_enable_x64``, and an int64
    constant made as int32 must not be reused where int64 is computed (or the other way)."""

    def __init__(self, value: Any) -> None:
        self.value, self.arrays = value, {}

    def get(self) -> Any:
        import jax
        import numpy as np

        value = self.value
        if not isinstance(value, torch.Tensor):
            return value
        mode = jax.dtypes.canonicalize_dtype(np.int64)  # (int32 without x64: the scoped setting)
        array = self.arrays.get(mode)
        if array is None:
            array = self.arrays[mode] = jax.numpy.asarray(value.detach().cpu().numpy())
        return array


def _constant(value: Any) -> _Constant:
    return _Constant(value)


def _as_jax(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        import jax.numpy as jnp

        return jnp.asarray(value)
    return value


def _attribute(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _writes_first_argument(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    arguments = target._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


class _InPlace:
    """An in-place op of a graph traced without functionalization (``masked_fill_`` in a
    backward): its functional op's rule, the result replacing the written value. Only a value
    the graph made itself, not a view (a jax value has no views to update): else a
    ``PassError`` asking for a functionalized graph."""

    def __init__(self, rule: Callable[..., Any]) -> None:
        self.rule = rule

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.rule(*args, **kwargs)


def _in_place_rule(node: fx.Node) -> _InPlace:
    target = node.target
    written = node.args[0] if node.args else None
    if not isinstance(written, fx.Node) or written.op != "call_function" or is_view(written) or any(
        is_view(user) for user in written.users
    ):
        raise PassError(
            f"lower_to_jax: {node.format_node()}: writes into an input or a view; functionalize the graph first "
            "(make_fx(torch.func.functionalize(f)) or AOTAutograd's graphs)"
        )
    packet = getattr(torch.ops.aten, target.overloadpacket.__name__.rstrip("_"), None)
    functional = getattr(packet, target._overloadname, None) if packet is not None else None
    return _InPlace(rule_of(functional if functional is not None else target, node.format_node()))


def _with_effects(rule: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``with_effects(token, op, *args)`` (an op AOTAutograd orders by a token: a linalg
    op's check of its status) as ``(token, op's rule(*args))``: a jax program's order is its data's."""

    def with_effects(token: Any, op: Any, *args: Any, **kwargs: Any) -> tuple:
        return token, rule(*args, **kwargs)

    return with_effects


def jax_function(gm: fx.GraphModule) -> Callable[..., Any]:
    """The JAX function a lowered graph computes (made once per graph; see the module docstring)."""
    made = _FUNCTIONS.get(gm)
    if made is not None:
        return made
    steps: list[tuple[fx.Node, Any]] = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            if target in RUNNERS:
                steps.append((node, target))
            elif target is torch.ops.higher_order.with_effects:
                steps.append((node, _with_effects(rule_of(node.args[1], node.format_node()))))
            elif isinstance(target, torch._ops.HigherOrderOperator):
                raise PassError(f"lower_to_jax: {node.format_node()}: a HOP left in a lowered graph")
            elif _writes_first_argument(target):
                steps.append((node, _in_place_rule(node)))
            else:
                steps.append((node, rule_of(target, node.format_node())))
        elif node.op == "get_attr":
            steps.append((node, _constant(_attribute(gm, node.target))))
        elif node.op == "call_module":
            steps.append((node, jax_function(gm.get_submodule(node.target))))
        elif node.op not in ("placeholder", "output"):
            raise PassError(f"lower_to_jax: {node.format_node()}: a {node.op} node has no JAX meaning")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    output = next(iter(gm.graph.find_nodes(op="output")))
    codegen = gm.graph._codegen  # flattens pytree inputs / rebuilds outputs for exported graphs

    def run(*args: Any) -> Any:
        flat = codegen.process_inputs(*args)
        if len(flat) != len(placeholders):
            raise TypeError(f"{gm.__class__.__name__}: takes {len(placeholders)} inputs, got {len(flat)}")
        # a numpy input as a jax array: rules use jax's methods on their operands (``x.at``)
        flat = [_as_jax(value) for value in flat]
        env: dict[fx.Node, Any] = dict(zip(placeholders, flat))
        for node, what in steps:
            if node.op == "get_attr":
                env[node] = what.get()
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = what(*args, **kwargs)
            if isinstance(what, _InPlace):  # later readers of the written value see the new one
                env[node.args[0]] = env[node]
        return codegen.process_outputs(fx.node.map_arg(output.args[0], env.__getitem__))

    run.__name__ = run.__qualname__ = f"jax_{gm.__class__.__name__}"
    _FUNCTIONS[gm] = run
    return run
