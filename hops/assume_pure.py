"""``hops.assume_pure(fn)``: trace ``fn`` once per input signature, then run the cached graphs.

The first call with a signature (the pytree structure of the arguments; each tensor's
shape, strides (a graph keeps the layout decisions of its trace: a ``view`` valid on those
strides only), dtype, device, layout and ``requires_grad``; each other leaf's value, spec values
included; and whether grad mode is on) traces ``fn`` above autograd (its ops as it calls
them, its grad mode changes kept), the HOPs of this package kept as nodes, and caches the
graph. Later calls with that signature run the cached graph: ``fn``'s Python does not run
again (as ``jax.jit``). ``fn`` may call every HOP of this package.

How the graph runs depends on the device's target. On XLA tensors (a target that registers
a graph compiler) AOTAutograd splits it into forward and backward graphs, lowered by the
XLA target and each staged once into one XLA computation that a call binds (one node of the
lazy graph per call; ``_graph_function``); outputs are then new tensors, except one that is
a view of an input (it stays one). Elsewhere nothing would be gained by staging, so a call
runs the graph's generated code, each op called through torch's Python binding
(``_eager_graph``), and the autograd engine differentiates it as it runs, as it would
``fn``: a call costs the ops, not ``fn``'s Python (its modules, its control flow), and no more
than running ``fn`` (``benchmarks/trace_once.py``). Such a trace has no backward graph.

``fn`` must be pure in its tensors: mutating an input or a tensor it closes over is refused
when it is traced (a cached graph would not repeat the mutation), and so is a tensor it
reads from its closure or globals (a cached graph would keep the value it had when traced,
and a parameter's gradient would be lost): pass tensors as arguments, or wrap a module
(``hops.assume_pure(module)`` passes its parameters and buffers as arguments on each call;
its modules' training flags are part of the signature, so ``eval()`` and ``train()`` switch
graphs). Python side effects happen once per signature, when tracing.

The cache is bounded (``max_cache_size`` signatures, least recently used evicted) and
inspectable: ``cache_info()`` counts hits, misses and traces; ``cached()`` lists each
signature with its forward and backward graphs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from hops import _eager_graph, _graph_function, _targets

__all__ = ["assume_pure", "PureFunction", "PureModule", "CacheInfo", "CachedTrace", "ImpureFunctionError"]


class ImpureFunctionError(RuntimeError):
    """``fn`` does something a cached graph would not repeat (the message says what)."""


CacheInfo = collections.namedtuple("CacheInfo", "hits misses traces size max_size")


@dataclasses.dataclass
class CachedTrace:
    """One signature's traced graphs: ``forward`` (and, on a staging target, ``backward``
    once a backward ran)."""

    signature: str
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    run: Callable | None = dataclasses.field(default=None, repr=False)
    positions: tuple[int, ...] = ()
    key: tuple = dataclasses.field(default=(), repr=False)
    out_spec: Any = None
    single_output: bool = dataclasses.field(default=False, repr=False)


def assume_pure(fn: Callable | None = None, *, max_cache_size: int = 8) -> Any:
    """``fn`` traced once per input signature (see the module docstring); a decorator.

    An ``nn.Module`` gives a ``PureModule`` whose parameters and buffers are arguments."""
    if fn is None:
        return functools.partial(assume_pure, max_cache_size=max_cache_size)
    if isinstance(max_cache_size, bool) or not isinstance(max_cache_size, int) or max_cache_size < 1:
        raise TypeError(f"assume_pure: max_cache_size must be an int >= 1, got {max_cache_size!r}")
    if isinstance(fn, torch.nn.Module):
        return PureModule(fn, max_cache_size=max_cache_size)
    if not callable(fn):
        raise TypeError(f"assume_pure: expected a function or an nn.Module, got {type(fn).__name__}")
    return PureFunction(fn, max_cache_size=max_cache_size)


class PureFunction:
    """``fn`` with a cache of traced graphs per input signature (``hops.assume_pure``)."""

    def __init__(self, fn: Callable, *, max_cache_size: int = 8) -> None:
        self.fn = fn
        self.max_cache_size = max_cache_size
        self._cache: collections.OrderedDict[tuple, CachedTrace] = collections.OrderedDict()
        # Other keys of cached traces (``PureModule``'s state signatures), evicted with them.
        self._aliases: collections.OrderedDict[tuple, CachedTrace] = collections.OrderedDict()
        self._hits = self._misses = self._traces = 0
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, tensors = self._entry(args, kwargs)
        outputs = entry.run(*tensors)  # as ``_outputs``, one Python frame fewer per call
        if entry.single_output:
            return outputs[0]
        return pytree.tree_unflatten(list(outputs), entry.out_spec)

    def _entry(self, args: tuple, kwargs: dict) -> tuple[CachedTrace, list[torch.Tensor]]:
        """The call's cached trace (traced on a miss) and its tensors in the trace's order."""
        tensors: list[torch.Tensor] = []
        parts: list = [_FAST_KEY, torch.is_grad_enabled()]
        fast = _walk((args, kwargs), tensors, parts)
        try:
            if fast:
                key = tuple(parts)
            else:
                leaves, treedef = pytree.tree_flatten((args, kwargs))
                key = (treedef, torch.is_grad_enabled(), *map(_leaf_key, leaves))
            entry = self._cache.get(key)
        except TypeError:  # an unhashable leaf: say which
            raise TypeError(_unhashable(self._name, (args, kwargs))) from None
        if entry is None:
            self._misses += 1
            if fast:
                leaves, treedef = pytree.tree_flatten((args, kwargs))
            entry = self._trace(leaves, treedef, key)
        else:
            self._hits += 1
            self._cache.move_to_end(key)
        if not fast:
            tensors = [leaves[i] for i in entry.positions]
        return entry, tensors

    @staticmethod
    def _outputs(entry: CachedTrace, tensors: list[torch.Tensor]) -> Any:
        outputs = entry.run(*tensors)
        if entry.single_output:
            return outputs[0]
        return pytree.tree_unflatten(list(outputs), entry.out_spec)

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, self._traces, len(self._cache), self.max_cache_size)

    def cached(self) -> list[CachedTrace]:
        """Each cached signature with its graphs, least recently used first."""
        return list(self._cache.values())

    def cache_clear(self) -> None:
        self._cache.clear()
        self._aliases.clear()
        self._hits = self._misses = self._traces = 0

    def _trace(self, leaves: list, treedef: Any, key: tuple) -> CachedTrace:
        from torch.fx.experimental.proxy_tensor import make_fx

        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        tensors = [leaves[i] for i in positions]
        entry = CachedTrace(_signature_text(treedef, leaves), positions=positions)
        fn = self.fn
        captured = _captured_tensors(fn)
        output_requires_grad: list[bool] = []

        def flat_fn(*flat_tensors: torch.Tensor) -> tuple:
            full = list(leaves)
            for i, tensor in zip(positions, flat_tensors):
                full[i] = tensor
            args, kwargs = pytree.tree_unflatten(full, treedef)
            with _RefuseRealMutation(self._name, captured):
                result = fn(*args, **kwargs)
            outputs, entry.out_spec = pytree.tree_flatten(result)
            output_requires_grad[:] = [getattr(value, "requires_grad", False) for value in outputs]
            for path, value in zip(_paths(entry.out_spec), outputs):
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"assume_pure({self._name}): returns a {type(value).__name__} at output{path}; "
                        "a traced function returns tensors (in any pytree)"
                    )
            return tuple(outputs)

        compiler = _targets.graph_compiler(tensors)
        # Traced above autograd (the ops as the function calls them, its grad mode changes
        # kept) and without functionalization, to see mutations: AOTAutograd would turn a
        # mutated input into an epilogue copy and hide it.
        graph = make_fx(flat_fn, tracing_mode="fake", pre_dispatch=True, _allow_non_fake_inputs=True)(*tensors)
        _check_pure(self._name, graph, tensors, treedef, leaves, positions, captured)
        # A composite op may write into its arguments without saying so in its schema
        # (instance_norm's running statistics): its ATen ops do.
        aten_graph = make_fx(graph, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
        _check_pure(self._name, aten_graph, tensors, treedef, leaves, positions, captured)
        if compiler is None:
            # Off a staging target: the graph's code runs, the autograd engine differentiates
            # it as it runs (as the function itself), at no more cost than its Python.
            entry.forward, entry.run = graph, _eager_graph.EagerGraph(graph)
            return self._store(key, entry)

        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        graphs = _graph_function.split(
            graph,
            tensors,
            needs_grad=needs_grad,
            output_requires_grad=output_requires_grad,
            compiler=compiler,
            on_backward_compiled=functools.partial(setattr, entry, "backward"),
        )
        if graphs is not None:
            entry.forward, entry.run = graphs.forward_graph, graphs
        else:
            entry.run = self._aot_runtime(graph, entry, compiler)
        return self._store(key, entry)

    def _store(self, key: tuple, entry: CachedTrace) -> CachedTrace:
        entry.key = key
        entry.single_output = entry.out_spec is not None and entry.out_spec.is_leaf()
        self._traces += 1
        self._cache[key] = entry
        while len(self._cache) > self.max_cache_size:
            _, evicted = self._cache.popitem(last=False)
            for alias in [k for k, v in self._aliases.items() if v is evicted]:
                del self._aliases[alias]
        return entry

    def _alias(self, key: tuple, entry: CachedTrace) -> None:
        """``key`` also finds ``entry`` while ``entry`` is cached."""
        if self._cache.get(entry.key) is entry:
            self._aliases[key] = entry
            while len(self._aliases) > self.max_cache_size:
                self._aliases.popitem(last=False)

    @staticmethod
    def _aot_runtime(graph: fx.GraphModule, entry: CachedTrace, compiler: Callable | None) -> Callable:
        """AOTAutograd's own runtime for ``graph``: what ``_graph_function`` does not run
        (outputs aliasing inputs, which it regenerates as views)."""
        from functorch.compile import aot_function, make_boxed_func

        def keep(name: str) -> Callable:
            def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Callable:
                setattr(entry, name, gm)
                if compiler is not None:
                    return compiler(gm, example_inputs)
                return make_boxed_func(gm)

            return compile_graph

        return aot_function(graph, fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    def __repr__(self) -> str:
        return f"assume_pure({self._name}, {self.cache_info()})"


class PureModule(torch.nn.Module):
    """``module`` whose forward is traced once per signature, its parameters and buffers
    passed as arguments on every call (so optimizer updates and gradients reach them)."""

    def __init__(self, module: torch.nn.Module, *, max_cache_size: int = 8) -> None:
        super().__init__()
        self.module = module

        def call_module(state: dict, modes: tuple, args: tuple, kwargs: dict) -> Any:
            # ``modes``: the modules' training flags, in the signature (``train()`` / ``eval()``
            # change what ``forward`` does: dropout, batch statistics); read off the modules.
            return torch.func.functional_call(module, state, args, kwargs)

        call_module.__qualname__ = type(module).__name__
        self.pure = PureFunction(call_module, max_cache_size=max_cache_size)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The state's signature read straight off the modules' tables, under the names they
        # store (their hashes cached): building the qualified-name dict that ``call_module``
        # takes, then walking it, costs more than the layer's Python saves (issue 32's
        # per-call budget); the dict is built only when this key is not cached.
        parameters: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        parts: list = [_STATE_KEY, torch.is_grad_enabled()]
        _state_signature(self.module, parameters, buffers, parts)
        tensors = parameters + buffers if buffers else parameters
        key = tuple(parts) if _walk((args, kwargs), tensors, parts) else None
        pure = self.pure
        if key is not None:
            try:
                entry = pure._aliases.get(key)
            except TypeError:  # an unhashable leaf: the call below says which
                entry = key = None
            if entry is not None:
                pure._hits += 1
                pure._aliases.move_to_end(key)
                pure._cache.move_to_end(entry.key)  # recently used under either key
                return pure._outputs(entry, tensors)
        state, modes = _module_state(self.module)
        entry, tensors = pure._entry((state, modes, args, kwargs), {})
        if key is not None:
            pure._alias(key, entry)
        return pure._outputs(entry, tensors)

    def cache_info(self) -> CacheInfo:
        return self.pure.cache_info()

    def cached(self) -> list[CachedTrace]:
        return self.pure.cached()

    def cache_clear(self) -> None:
        self.pure.cache_clear()


# Marks a key made by ``PureModule.forward``.
_STATE_KEY = object()


def _state_signature(module: torch.nn.Module, parameters: list, buffers: list, parts: list) -> None:
    """``module``'s parameters and buffers appended to ``parameters`` and ``buffers`` in
    ``_module_state``'s order, and to ``parts`` one flat, unambiguous signature of them: per
    module its training flag and its tables' names, then each tensor's ``_leaf_key`` (None for
    an empty slot)."""
    tables = module.__dict__  # the three tables read as one dict each (not three attribute lookups)
    parts.append(tables["training"])
    for table, tensors in ((tables["_parameters"], parameters), (tables["_buffers"], buffers)):
        if not table:
            parts.append(())
            continue
        parts.append(tuple(table))
        for tensor in table.values():
            if tensor is None:
                parts.append(None)
            else:
                tensors.append(tensor)
                parts.append(
                    (type(tensor), tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.layout, tensor.requires_grad)
                )
    children = tables["_modules"]
    parts.append(tuple(children))
    for child in children.values():
        if child is None:
            parts.append(None)
        else:
            _state_signature(child, parameters, buffers, parts)


def _module_state(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], tuple[bool, ...]]:
    """``module``'s parameters, then its buffers, by qualified name: what
    ``named_parameters`` and ``named_buffers`` (``remove_duplicate=False``) give, read from
    the modules' own tables (their generators cost ~3x more per call); and each module's
    training flag, in the same (pre-)order."""
    state: dict[str, torch.Tensor] = {}
    buffers: list[tuple[str, torch.Tensor]] = []
    modes: list[bool] = []
    _collect_state(module, "", state, buffers, modes)
    if buffers:
        state.update(buffers)
    return state, tuple(modes)


def _collect_state(module: torch.nn.Module, prefix: str, parameters: dict, buffers: list, modes: list) -> None:
    """Pre-order, children in registration order (as ``named_modules``)."""
    modes.append(module.training)
    for name, tensor in module._parameters.items():
        if tensor is not None:
            parameters[prefix + name] = tensor
    if module._buffers:
        for name, tensor in module._buffers.items():
            if tensor is not None:
                buffers.append((prefix + name, tensor))
    for name, child in module._modules.items():
        if child is not None:
            _collect_state(child, prefix + name + ".", parameters, buffers, modes)


# Marks a key made by ``_walk`` (a key made from a pytree spec starts with the spec).
_FAST_KEY = object()
_CONTAINERS = (tuple, list, dict)


def _walk(tree: tuple | list | dict, tensors: list, parts: list) -> bool:
    """The signature of ``tree`` (tuples, lists and dicts of leaves, exact types) appended to
    ``parts`` as one flat, unambiguous sequence (a container's entry says its type and length
    or keys; a leaf's entry starts with its type, a tensor's is ``_leaf_key``), and its tensors
    to ``tensors`` in pytree's leaf order. False (stop) at any other pytree node: the caller
    then keys the call by its pytree spec. A few times cheaper than flattening with pytree."""
    for value in tree.values() if type(tree) is dict else tree:
        kind = type(value)
        if kind is tuple or kind is list:
            parts.append((kind, len(value)))
            if not _walk(value, tensors, parts):
                return False
        elif kind is dict:
            parts.append((dict, *value))
            if not _walk(value, tensors, parts):
                return False
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
            parts.append((kind, value.shape, value.stride(), value.dtype, value.device, value.layout, value.requires_grad))
        elif value is None:  # a pytree node without leaves
            parts.append(None)
        elif isinstance(value, _CONTAINERS) or kind in pytree.SUPPORTED_NODES:
            return False
        else:
            parts.append((kind, value))
    return True


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (type(leaf), leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.layout, leaf.requires_grad)
    hash(leaf)  # a TypeError names the unhashable leaf in __call__
    return (type(leaf), leaf)


def _paths(spec: Any) -> list[str]:
    dummy = pytree.tree_unflatten([0] * spec.num_leaves, spec)
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(dummy)[0]]


def _unhashable(name: str, tree: Any) -> str:
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, torch.Tensor):
            try:
                hash(leaf)
            except TypeError:
                where = _argument_name(path)
                return (
                    f"assume_pure({name}): argument {where} is a {type(leaf).__name__}, which cannot be part "
                    "of a signature: pass tensors, hashable values (numbers, strings, specs) or pytrees of them"
                )
    return f"assume_pure({name}): an argument cannot be part of a signature"


def _argument_name(path: tuple) -> str:
    # path[0] selects args (0) or kwargs (1)
    head, rest = path[0], path[1:]
    kind = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    return kind + pytree.keystr(rest)


def _signature_text(treedef: Any, leaves: list) -> str:
    def describe(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            grad = ", requires_grad" if leaf.requires_grad else ""
            return f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)} on {leaf.device}{grad}"
        return repr(leaf)

    args, kwargs = pytree.tree_unflatten([describe(leaf) for leaf in leaves], treedef)
    parts = [str(a) for a in args] + [f"{k}={v}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _captured_tensors(fn: Callable) -> dict[int, str]:
    """id -> name of the tensors ``fn`` can reach through its closure, its globals, or
    ``self`` (a bound method's module parameters and buffers)."""
    found: dict[int, str] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), name)
        elif isinstance(value, torch.nn.Module):
            for sub, tensor in [*value.named_parameters(), *value.named_buffers()]:
                found.setdefault(id(tensor), f"{name}.{sub}")

    target = inspect.unwrap(fn)
    if inspect.ismethod(target):
        add("self", target.__self__)
        target = target.__func__
    if inspect.isfunction(target):
        try:
            closure = inspect.getclosurevars(target)
        except (TypeError, ValueError):
            return found
        for name, value in {**closure.globals, **closure.nonlocals}.items():
            add(name, value)
    return found


class _RefuseRealMutation(torch.overrides.TorchFunctionMode):
    """While tracing, refuse an in-place op on a real tensor (one ``fn`` reached outside its
    arguments) before it runs: the trace must not change the caller's state."""

    def __init__(self, name: str, captured: dict[int, str]) -> None:
        super().__init__()
        self.name, self.captured = name, captured

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = getattr(func, "__name__", "")
        in_place = (op.endswith("_") and not op.endswith("__")) or op in _IN_PLACE_DUNDERS
        targets = [kwargs.get("out")] + ([args[0]] if in_place and args else [])
        for target in pytree.tree_leaves(targets):
            if isinstance(target, torch.Tensor) and not _is_traced(target):
                label = self.captured.get(id(target), "a tensor it closes over")
                raise ImpureFunctionError(
                    f"assume_pure({self.name}): mutates the tensor {label} ({op}); a cached graph would not "
                    "repeat the mutation: pass it as an argument and return the new value instead"
                )
        return func(*args, **kwargs)


_IN_PLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)


def _is_traced(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter)


def _base(node: Any) -> Any:
    """The placeholder or constant a (chain of) view(s) reads."""
    while isinstance(node, fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        aliases = [a for a in node.target._schema.arguments if a.alias_info is not None and not a.alias_info.is_write]
        if not aliases or not node.args:
            break
        node = node.args[0]
    return node


def _check_pure(
    name: str, graph: fx.GraphModule, tensors: list, treedef: Any, leaves: list, positions: tuple, captured: dict
) -> None:
    paths = [_argument_name(p) for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(leaves, treedef))[0]]
    placeholders = list(graph.graph.find_nodes(op="placeholder"))

    def what(node: Any) -> str:
        if isinstance(node, fx.Node) and node.op == "placeholder":
            return f"its input {paths[positions[placeholders.index(node)]]}"
        if isinstance(node, fx.Node) and node.op == "get_attr":
            tensor = getattr(graph, str(node.target), None)
            return f"the tensor {captured.get(id(tensor), 'it closes over')}"
        return ""

    for node in graph.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            schema = node.target._schema
            for argument, value in zip(schema.arguments, node.args):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    mutated = what(_base(value))
                    if mutated:
                        raise ImpureFunctionError(
                            f"assume_pure({name}): mutates {mutated} ({node.target}); a cached graph would not "
                            "repeat the mutation: return the new value instead"
                        )
    for node in graph.graph.find_nodes(op="get_attr"):
        tensor = getattr(graph, str(node.target), None)
        if isinstance(tensor, torch.Tensor) and (tensor.requires_grad or id(tensor) in captured):
            label = captured.get(id(tensor), "a tensor that requires grad")
            lost = " (and lose its gradient)" if tensor.requires_grad else ""
            raise ImpureFunctionError(
                f"assume_pure({name}): reads {label} from its closure or globals; a cached graph would keep "
                f"the value it had when traced{lost}: pass it as an argument, or wrap a module with "
                "hops.assume_pure(module)"
            )
