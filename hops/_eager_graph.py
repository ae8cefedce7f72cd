"""A traced graph run as eager code: the autograd engine records it, as it records the
function the graph was traced from.

``EagerGraph(gm)`` calls ``gm``'s generated Python directly (not through ``nn.Module``'s
call), with each ATen op node calling the op through torch's Python binding of the same name
(``torch.mul``, ``Tensor.view``, ``torch._C._nn.linear``) instead of its ``OpOverload``:
the binding parses its arguments in generated C++ code, the ``OpOverload`` by its schema at
run time, which costs a few microseconds more per op, as much as the op itself on small
tensors. A binding picks its overload from the arguments, so a node uses it only where that
is the node's own op: both, called on the node's fake values, dispatch the same ops (what a
composite op decomposes into included). ``gm`` itself is left as traced (it is what users
inspect); the graph that runs is a copy.

The bindings' namespaces (``torch._C._VariableFunctions``, ``torch._C._nn`` and the others
below, and ``torch._C.TensorBase``'s methods) are the same in torch 2.9 .. 2.15.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EagerGraph"]

_FUNCTION_NAMESPACES = tuple(
    namespace
    for namespace in (
        torch._C._VariableFunctions,
        getattr(torch._C, "_nn", None),
        getattr(torch._C, "_linalg", None),
        getattr(torch._C, "_special", None),
        getattr(torch._C, "_fft", None),
    )
    if namespace is not None
)


class EagerGraph:
    """``gm``'s code, called with the call's tensors; returns what ``gm`` returns."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph_module = gm
        graph = fx.Graph()
        environment: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            if _returns_its_input(node):
                environment[node] = environment[node.args[0]]
                continue
            copy = graph.node_copy(node, environment.__getitem__)
            binding = _binding(node) if node.op == "call_function" else None
            if binding is not None:
                copy.target = binding
            environment[node] = copy
        self.run_graph = fx.GraphModule(gm, graph)
        self.num_bound = sum(n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
        self._forward: Callable = self.run_graph.forward

    def __call__(self, *tensors: torch.Tensor) -> Any:
        return self._forward(*tensors)


def _returns_its_input(node: fx.Node) -> bool:
    """``node`` gives its first argument (``to`` its own dtype returns the tensor itself), or an
    alias of it nothing tells apart (read only by ops that write nothing; not an output): the
    copy uses the argument, one op call fewer."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is torch.ops.aten.alias.default:
        return all(_writes_nothing(user) for user in node.users)
    if node.target is not torch.ops.aten.to.dtype:
        return False
    value = node.args[0].meta.get("val")
    bound = torch.ops.aten.to.dtype._schema
    arguments = dict(zip((a.name for a in bound.arguments), node.args)) | dict(node.kwargs)
    return (
        isinstance(value, torch.Tensor)
        and arguments.get("dtype") == value.dtype
        and not arguments.get("copy", False)
        and arguments.get("memory_format") in (None, torch.preserve_format)
    )


def _writes_nothing(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and not _writes(node.target)


def _writes(op: torch._ops.OpOverload) -> bool:
    """``op``'s schema says it writes into an argument."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


class _Record(TorchDispatchMode):
    """The ops dispatched below, with their argument structure."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append((func, _shape_of((args, kwargs))))
        return func(*args, **kwargs)


def _shape_of(tree: Any) -> Any:
    leaves, spec = pytree.tree_flatten(tree)
    described = tuple(
        ("tensor", tuple(v.shape), v.dtype, v.stride()) if isinstance(v, torch.Tensor) else (type(v), v) for v in leaves
    )
    return spec, described


def _candidates(op: torch._ops.OpOverload) -> list[Callable]:
    name = op._schema.name.split("::", 1)[-1]
    found = [getattr(namespace, name) for namespace in _FUNCTION_NAMESPACES if hasattr(namespace, name)]
    method = getattr(torch._C.TensorBase, name, None)
    arguments = op._schema.arguments
    if method is not None and arguments and arguments[0].name == "self":
        found.append(method)
    return found


def _binding(node: fx.Node) -> Callable | None:
    """A Python binding that runs ``node``'s op on ``node``'s arguments, or None."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    if _writes(op):
        return None  # checked on the fake values, it would change them
    values = [n.meta.get("val") for n in node.all_input_nodes]
    if any(not isinstance(v, torch.Tensor) for v in values):
        return None  # an argument without a tensor value: not checkable
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    # A fake mode even without tensor arguments: a factory of random numbers must not draw.
    fake_mode = detect_fake_mode(values) if values else FakeTensorMode()
    if fake_mode is None:
        return None

    def dispatched(fn: Callable) -> list | None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        record = _Record()
        try:
            with fake_mode, record:
                result = fn(*args, **kwargs)
        except Exception:  # the binding refuses these arguments: not this op
            return None
        if isinstance(result, list) and all(user.target is operator.getitem for user in node.users):
            result = tuple(result)  # a list of tensors read by index only: as a tuple
        return [*record.calls, _shape_of(result)]

    expected = dispatched(op)
    if expected is None:
        return None
    for candidate in _candidates(op):
        if dispatched(candidate) == expected:
            return candidate
    return None
