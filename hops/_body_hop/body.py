"""What a region body does, learned from one run on fake stand-ins before anything real runs.

Every HOP with a body (scan, local_map, named_scope) calls ``inspect_body`` from its public
function once per call. The body runs on fresh fake copies of what it will really see, under
a ``TorchFunctionMode`` that swaps every tensor it reads from outside its inputs (its closure,
globals, module parameters) for a fake copy too. So the run touches no caller tensor, and
tells:

- which outside tensors the body reads (``closed``): tracers need them as explicit inputs
  (``lift_closure``) so they become placeholders and receive gradients;
- whether the body writes into an input or an outside tensor: refused here, naming the
  tensor, before the real computation could change the caller's data;
- the structure and metadata of its outputs (a scan's ``y`` pytree, a region's outputs),
  so no tracer needs a second call of the body to learn them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from hops import _compat
from hops._body_hop.subgraph import body_name, named

__all__ = [
    "BodyInfo", "StandInRun", "inspect_body", "run_on_stand_ins", "lift_closure", "stand_in", "describe_tensor",
    "fake_run_context", "at_boundary",
]


def at_boundary(values: Sequence[Any]) -> tuple:
    """``values`` in the layout every body may assume of what it takes and every body HOP
    gives of what it returns: each tensor contiguous (row-major, dense, no expanded dim; a
    storage offset changes nothing a graph decides); a tensor already so is itself.

    A body is traced once, on stand-ins, and the graph keeps what the trace decided from
    their layout (a ``view`` where the stand-in allowed one, no copy where ``contiguous()``
    found nothing to do). What reaches it at run time may be laid out otherwise: the gradient
    of a ``.sum()`` is expanded (stride 0), an SDPA output is permuted, a user's operand may
    be transposed, sliced or channels-last. Every HOP therefore makes its body's operands
    contiguous before the body sees them (the stand-ins it is traced on included), and its
    results contiguous before the caller does: the fake rules say so, and a loop's carry
    keeps one layout from step to step."""
    return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in values)


class BodyMutationError(ValueError):
    """A body writes into a tensor it does not own (an input or a closed-over tensor)."""


@dataclasses.dataclass
class BodyInfo:
    """The result of ``inspect_body``.

    ``closed``: tensors the body read from outside its inputs, in first-read order (the
    caller's objects). ``outputs``: the body's fake outputs, as it returned them.
    ``complete``: False when the run had to stop early (the body reads a tensor's value as a
    Python number in eager mode); nothing but ``closed`` found so far is then known.
    """

    closed: list[torch.Tensor]
    outputs: Any
    complete: bool = True
    # The closed-over tensors as the body's code reads them (``closed`` holds what enclosing
    # traces know them as; the same objects unless bodies nest).
    read: list[torch.Tensor] = dataclasses.field(default_factory=list)


def unwrap_functional(t: torch.Tensor) -> torch.Tensor:
    """The tensor under a functionalization wrapper (AOTAutograd's or torch_xla's), if any."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(t, FunctionalTensor):
        t = t.elem
    if torch._is_functional_tensor(t):
        torch._sync(t)
        t = torch._from_functional_tensor(t)
    return t


def wrap_functional(ctx: Any, values: Any) -> Any:
    """``ctx.wrap_tensors(values)`` for a HOP's functionalize rule, except under torch's C++
    functionalization (XLA and lazy tensors outside any tracer): there torch wraps results at
    functorch level 0, which makes them look like ``torch.func.functionalize``'s tensors to
    whoever inspects them (Dynamo, fakeifying a graph break's inputs, asserts on them). They are
    wrapped as torch_xla wraps its own tensors instead: without a functorch level."""
    from torch._subclasses.functional_tensor import CppFunctionalizeAPI

    if type(ctx) is CppFunctionalizeAPI:
        return pytree.tree_map_only(torch.Tensor, torch._to_functional_tensor, values)
    return ctx.wrap_tensors(values)


def version_counter(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference tensor (created under ``torch.inference_mode``),
    which has no version counter: in-place writes into one go unseen by the checks that
    compare versions (inspection runs on stand-ins that have one)."""
    return None if t.is_inference() else t._version


def stand_in(t: torch.Tensor, mode: Any) -> torch.Tensor:
    """A fresh fake tensor of ``mode`` with ``t``'s metadata: same sizes (symbolic ones kept),
    strides, dtype, device and ``requires_grad``; writing into it touches nothing of ``t``."""
    inner = unwrap_functional(t)
    # Not an inference tensor even under torch.inference_mode: a stand-in has a version
    # counter, so writes into it are seen.
    with torch.inference_mode(False), mode:
        if _compat.is_functorch_wrapped(inner):
            # A torch.func wrapper: its logical shape is what the body sees (a batched
            # tensor's has no batch dim); its strides are not queryable.
            fresh = torch.empty(inner.shape, dtype=inner.dtype, device=inner.device)
        else:
            fresh = torch.empty_strided(inner.size(), inner.stride(), dtype=inner.dtype, device=inner.device)
        if t.requires_grad and (t.is_floating_point() or t.is_complex()):
            # A non-leaf, so that an in-place write is recorded as such instead of autograd's
            # "leaf variable" error, and the body may still differentiate through it. Made
            # outside any torch.func transform: a body calling torch.func.grad reads closed-over
            # tensors inside it, where requires_grad_ is refused.
            with _compat.outside_functorch():
                fresh = fresh.requires_grad_(True).clone()
    return fresh


def distinct_tensors(values: Sequence[Any]) -> list[Any]:
    """``values`` with every tensor a new object like it, for tracing a body on them.

    make_fx knows a traced value by its tensor object, and a lifted closure is substituted
    by identity. A tensor given twice (a carry that is also an additional input) would make
    one placeholder stand for both, and an operand that is also a closure tensor
    (``scan(lambda d, x: d + x * c, c, xs)``) would have its reads as ``d`` substituted too:
    either way the body would read the wrong input. So no body is traced on the caller's
    tensor objects: a fake stand-in of a fake tensor, a detached alias of a real one (no
    copy), made unseen by any tracer."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    result = []
    with disable_proxy_modes_tracing():
        for value in values:
            if isinstance(value, torch.Tensor):
                mode = detect_fake_mode([unwrap_functional(value)])
                if mode is not None:
                    value = stand_in(value, mode)
                else:
                    value = value.detach().requires_grad_(value.requires_grad)
            result.append(value)
    return result


def inspection_mode(values: Sequence[Any]) -> Any:
    """The fake mode the values already live in (tracing), else a fresh one (eager)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    inner = [_compat.peel_functorch(unwrap_functional(v)) for v in values if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(inner)
    return mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=False)


@contextlib.contextmanager
def fake_run_context() -> Iterator[None]:
    """Run Python over fake tensors outside any tracer, mode or transform, unseen: no proxy
    recording, no functionalization, no torch.func transform, no dispatch mode of the caller
    (activation checkpointing's caches, a FLOP counter), no saved-tensor hooks of the caller
    (an offloading hook must see only real tensors), and ``torch.compile``d functions run
    eagerly (Dynamo cannot trace inside our inspection modes, and a compiled step must mean
    the same as its Python)."""
    from torch._higher_order_ops.utils import suspend_functionalization
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.utils._python_dispatch import _disable_current_modes

    # Hiding the caller's hooks takes hooks of our own, which a torch.func.grad inside the
    # body would refuse: pushed only when there is something to hide.
    hooks = torch.autograd.graph.saved_tensors_hooks(_keep, _keep) if _compat.caller_saved_tensors_hooks() else contextlib.nullcontext()
    with (
        suspend_functionalization(),
        disable_functional_mode(),
        disable_proxy_modes_tracing(),
        _disable_current_modes(),
        _compat.outside_functorch(),
        hooks,
        _compat.eager_stance(),
    ):
        yield


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


# Stand-ins made by any inspection (by id): never "outside" tensors for an enclosing
# inspection. (Not a WeakSet: its membership test compares tensors with ==.)
_STAND_INS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _is_stand_in(t: torch.Tensor) -> bool:
    return _STAND_INS.get(id(t)) is t


class _ClosureMode(TorchFunctionMode):
    """A mode that maps tensors a body reads from its closure to what stands for them.

    Bodies nest (a local_map region inside a scan step): an inner body reading the closure
    of both sees what the enclosing levels map that tensor to (their stand-in, or the
    placeholder that a lifted tensor became), so the inner level lifts the value the outer
    trace knows, not the caller's tensor. ``_ACTIVE`` holds the modes in the order entered.
    """

    def map(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def resolve(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the levels entered before this one see it."""
        for outer in _ACTIVE[: _ACTIVE.index(self)]:
            t = outer.map(t)
        return t


_ACTIVE: list[_ClosureMode] = []


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    inner = t.elem if isinstance(t, FunctionalTensor) else t
    return isinstance(inner, FakeTensor)


class _SwapOutsideTensors(_ClosureMode):
    """Swaps tensors a body reads from outside its inputs for fake copies, and records them."""

    def __init__(
        self, mode: Any, known: Sequence[torch.Tensor], refuse_collectives: str | None = None, only_real: bool = False
    ) -> None:
        super().__init__()
        self.mode = mode
        # Swap only tensors that are not fake (the rest the fake run takes as they are).
        self.only_real = only_real
        self.refuse_collectives = refuse_collectives
        self.alive: list[torch.Tensor] = list(known)  # keeps ids unique while inspecting
        self.known = {id(t) for t in known}
        # id(outside tensor) -> (the tensor as enclosing levels know it, its stand-in, the
        # stand-in's version when made, the tensor as read)
        self.outside: dict[int, tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = {}

    def map(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.known or _is_stand_in(t):
            return t
        if self.only_real and _is_fake(t):
            return t
        entry = self.outside.get(id(t))
        if entry is None:
            original = self.resolve(t)
            copy = stand_in(original, self.mode)
            _STAND_INS[id(copy)] = copy
            entry = self.outside[id(t)] = (original, copy, copy._version, t)
            self.known.add(id(copy))
            self.alive.append(copy)
        return entry[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.refuse_collectives is not None:
            _refuse_collective(func, self.refuse_collectives)
        args, kwargs = pytree.tree_map_only(torch.Tensor, self.map, (args, kwargs or {}))
        result = func(*args, **kwargs)
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self.known:
                self.known.add(id(leaf))
                self.alive.append(leaf)
        return result


# The functional collectives' op namespaces (torch.distributed._functional_collectives).
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def _refuse_collective(func: Any, refusal: str) -> None:
    name = getattr(func, "_qualified_op_name", None)
    if name is None and isinstance(func, torch._ops.OpOverload):
        name = func._schema.name
    if isinstance(name, str) and name.split("::")[0] in _COLLECTIVE_NAMESPACES:
        raise ValueError(refusal.replace("{collective}", name))


def inspect_body(
    body: Callable,
    inputs: Sequence[Any],
    *,
    what: str,
    input_names: Callable[[int], str],
    user_function: Any = None,
    eager: bool = False,
    refuse_collectives: str | None = None,
) -> BodyInfo:
    """Run ``body(*inputs)`` once on fake stand-ins (see the module docstring).

    ``what`` names the body in errors (``"scan(step)"``); ``input_names(i)`` names input ``i``
    by key path (``"xs['w']"``); ``user_function`` is searched for the name of a closed-over tensor the
    body writes into. Raises ``BodyMutationError`` naming the tensor the body writes into, and
    ``ValueError`` for Python control flow on a tensor's value while tracing. With ``eager``, a
    body that reads a tensor's value as a Python number cannot be inspected on fakes: the
    result is then incomplete instead of an error (it runs for real). ``refuse_collectives``:
    a message (``{collective}`` names the op) raised as ``ValueError`` if the body calls a
    functional collective.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    mode = inspection_mode(inputs)
    with fake_run_context():
        stand_ins = [stand_in(v, mode) if isinstance(v, torch.Tensor) else v for v in inputs]
        _STAND_INS.update((id(v), v) for v in stand_ins if isinstance(v, torch.Tensor))
        tensors = [(i, v) for i, v in enumerate(stand_ins) if isinstance(v, torch.Tensor)]
        versions = [v._version for _, v in tensors]
        swap = _SwapOutsideTensors(mode, [v for _, v in tensors], refuse_collectives)
        try:
            with mode, swap:
                outputs = body(*stand_ins)
        except (GuardOnDataDependentSymNode, DataDependentOutputException) as e:
            if eager:
                return BodyInfo([e[0] for e in swap.outside.values()], None, False, [e[3] for e in swap.outside.values()])
            raise ValueError(
                f"{what}: the body reads a tensor's value in Python ({type(e).__name__}); traced, a "
                "body is recorded once for every call, so its Python control flow and numbers cannot "
                "depend on tensor data (use torch.where / torch.cond, or pass the number as a Python value)"
            ) from None
        for (i, value), version in zip(tensors, versions):
            if value._version != version:
                raise BodyMutationError(
                    f"{what}: the body writes into its input {input_names(i)} in place; a body must be "
                    "functional (compute a new tensor and return it instead)"
                )
        for original, copy, version, _ in swap.outside.values():
            if copy._version != version:
                raise BodyMutationError(
                    f"{what}: the body writes in place into {describe_tensor(original, user_function)}, "
                    "which it reads from outside its inputs; a body must be functional (pass the tensor "
                    "in, e.g. as a carry, and return its new value)"
                )
    return BodyInfo([e[0] for e in swap.outside.values()], outputs, True, [e[3] for e in swap.outside.values()])


@dataclasses.dataclass
class StandInRun:
    """The result of ``run_on_stand_ins``.

    ``outputs``: the body's fake outputs, as it returned them. ``read``: the tensors it read
    from outside its inputs, as its code reads them (the caller's objects), in first-read
    order. With ``dependencies``: ``input_used[i]`` / ``read_used[j]`` say whether a
    differentiable output depends on input ``i`` / ``read[j]`` (both need grad for that).
    """

    outputs: Any
    read: list[torch.Tensor]
    input_used: list[bool] = dataclasses.field(default_factory=list)
    read_used: list[bool] = dataclasses.field(default_factory=list)


def run_on_stand_ins(
    body: Callable, inputs: Sequence[Any], *, dependencies: bool = False, needs_grad: Sequence[bool] = ()
) -> StandInRun:
    """Run ``body(*inputs)`` once on fake stand-ins, for its outputs' metadata: its inputs and
    every real tensor it reads from its closure (or a graph's constants) are fake copies (a
    fake-tensor run cannot take real tensors). Nothing is checked here (see
    ``inspect_body``). With ``dependencies`` (grad enabled), also which inputs and closure
    tensors requiring grad (input ``i`` also where ``needs_grad[i]``) a differentiable output
    depends on (``StandInRun``)."""
    mode = inspection_mode(inputs)
    with fake_run_context(), (torch.enable_grad() if dependencies else contextlib.nullcontext()):
        stand_ins = [stand_in(v, mode) if isinstance(v, torch.Tensor) else v for v in inputs]
        for i, need in enumerate(needs_grad):
            value = stand_ins[i]
            if dependencies and need and not value.requires_grad and (value.is_floating_point() or value.is_complex()):
                with mode:
                    stand_ins[i] = value.requires_grad_(True).clone()
        _STAND_INS.update((id(v), v) for v in stand_ins if isinstance(v, torch.Tensor))
        # Only real tensors are swapped: a fake one (of the trace a body was lifted in) is
        # read as it is, so a lifted body's substitutions and nested bodies see what they
        # would see in the trace.
        swap = _SwapOutsideTensors(mode, [v for v in stand_ins if isinstance(v, torch.Tensor)], only_real=True)
        with mode, swap:
            outputs = body(*stand_ins)
        read = [entry[3] for entry in swap.outside.values()]
        if not dependencies:
            return StandInRun(outputs, read)
        copies = [entry[1] for entry in swap.outside.values()]
        candidates = [*stand_ins, *copies]
        wanted = [i for i, v in enumerate(candidates) if isinstance(v, torch.Tensor) and v.requires_grad]
        differentiable = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
        used = [False] * len(candidates)
        if wanted and differentiable:
            with mode:
                grads = torch.autograd.grad(
                    differentiable,
                    [candidates[i] for i in wanted],
                    grad_outputs=[torch.ones_like(o) for o in differentiable],
                    allow_unused=True,
                )
            for i, grad in zip(wanted, grads):
                used[i] = grad is not None
    return StandInRun(outputs, read, used[: len(stand_ins)], used[len(stand_ins) :])


def describe_tensor(tensor: torch.Tensor, fn: Any) -> str:
    """A name for ``tensor`` as ``fn``'s code sees it: a closure variable, a global, or a
    parameter/buffer of a module ``fn`` belongs to; else its shape and dtype."""
    shape = f"shape {tuple(tensor.shape)} {tensor.dtype}"
    for owner, prefix in _owners(fn):
        if isinstance(owner, torch.nn.Module):
            for name, value in [*owner.named_parameters(), *owner.named_buffers()]:
                if value is tensor:
                    return f"{prefix}{name!r} ({shape})"
        elif isinstance(owner, types.FunctionType):
            if owner.__closure__:
                for name, cell in zip(owner.__code__.co_freevars, owner.__closure__):
                    try:
                        if cell.cell_contents is tensor:
                            return f"{name!r} ({shape}, closed over by {owner.__name__})"
                    except ValueError:  # an empty cell
                        continue
            for name in owner.__code__.co_names:
                if owner.__globals__.get(name) is tensor:
                    return f"the global {name!r} ({shape}, read by {owner.__name__})"
    return f"a tensor of {shape}"


def _owners(fn: Any) -> Iterator[tuple[Any, str]]:
    """Objects whose attributes ``fn`` may read: itself, what it wraps, its module."""
    seen: set[int] = set()
    stack = [fn]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.nn.Module):
            yield item, f"{type(item).__name__} parameter "
            continue
        if isinstance(item, types.MethodType):
            stack += [item.__self__, item.__func__]
            continue
        if isinstance(item, types.FunctionType):
            yield item, ""
            for cell in item.__closure__ or ():
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if callable(value):
                    stack.append(value)
            continue
        for attribute in ("func", "__wrapped__"):  # functools.partial, functools.wraps
            inner = getattr(item, attribute, None)
            if inner is not None:
                stack.append(inner)


class _SubstituteTensors(_ClosureMode):
    """Replaces the closure's tensors by the inputs that stand for them."""

    def __init__(self, replacements: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.replacements = replacements

    def map(self, t: torch.Tensor) -> torch.Tensor:
        return self.replacements.get(id(t), t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(torch.Tensor, self.map, (args, kwargs or {}))
        return func(*args, **kwargs)


def active_closure_modes() -> tuple:
    """The closure modes in effect, outermost first: what the tensors a body closes over
    read as here (an enclosing inspection's stand-ins, a lifted body's inputs)."""
    return tuple(_ACTIVE)


def lift_closure(body: Callable, num_inputs: int, read: Sequence[torch.Tensor]) -> Callable:
    """``body`` taking one extra trailing input per tensor in ``read`` (tensors its code reads
    from its closure; named like ``body``): while it runs, every read of one of them reads the
    input that stands for it."""
    read = list(read)

    def lifted(*values: Any) -> Any:
        replacements = {id(t): value for t, value in zip(read, values[num_inputs:])}
        with _SubstituteTensors(replacements):
            return body(*values[:num_inputs])

    return named(lifted, body_name(body))
