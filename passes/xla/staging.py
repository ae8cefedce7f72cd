"""Stage a function of XLA tensors once into one XLA computation, then call it by binding.

``stage(fn, shapes)`` runs ``fn`` once on placeholder tensors (a shape and a dtype, no
data) and builds what it computed into one XLA computation. ``call_staged`` then runs it on
real XLA tensors as one ``_xla_user_computation``: one node of torch_xla's lazy graph per
call, whatever ``fn`` holds, instead of re-tracing each of its ops (as JAX's ``jit`` replays
a staged computation). The XLA ``While`` of a scan calls a staged step in its body
(``while_loop.py``), ``hops.assume_pure`` and ``backend="hops_xla"`` call a staged graph.

A staged computation's parameters are the placeholders ``fn`` read, and what torch_xla
staged as parameters although ``fn`` did not take them ("hoisted"): device data it makes
for Python scalars, lifted constants, the RNG seed. So that none of them is an operand a
``local_map`` region inside could use (see ``LITERAL_ELEMENTS``):
- constants of at most ``LITERAL_ELEMENTS`` elements become literals of the caller.
  A hoisted scalar that a ``local_map`` body uses (``local * 2``) would otherwise be an
  operand that sharding propagation marks ``{manual}``; XLA cannot reshard the replicated
  value entering the call (or a loop) to that and aborts (``hlo_sharding.cc: Check failed:
  !IsManual()``). Literals never cross the boundary (as in JAX);
- larger constants are operands bound on every call;
- the RNG seed is an operand: each call (each step of a loop) gets a fresh one, so each
  draws different numbers.

A host value the function makes (``torch.tensor(2.0)``, ``torch.ones(())``, a small
``torch.tensor([...], device=x.device)``: in a traced graph a CPU constant or factory, then a
copy to the device or a 0-dim operand of a device op) is written into the computation as a
literal straight from the host (``_HostValuesAsLiterals``): it never becomes device data,
which torch_xla would upload and staging would read back to make the literal. Staging moves
no data either way; a call binds device tensors only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

#: Hoisted constants up to this many elements are written into the caller as literals.
LITERAL_ELEMENTS = 64

Metadata = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def metadata(tensors: Sequence[torch.Tensor]) -> Metadata:
    """Shapes and dtypes: what a staged computation is specific to."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


@dataclasses.dataclass(frozen=True)
class Staged:
    """``fn`` staged on placeholders of ``inputs``.

    ``computation`` takes one parameter per entry of ``sources``: ``("input", i)`` the
    i-th placeholder, ``("literal", cpu_tensor)`` a small constant, ``("constant", j)``
    ``constants[j]``, ``("seed", None)`` the RNG seed (an int64 scalar). It returns the
    tuple of ``fn``'s outputs (``outputs``: their shapes and dtypes).
    """

    name: str
    computation: Any
    sources: tuple[tuple[str, Any], ...]
    constants: tuple[torch.Tensor, ...]
    inputs: Metadata
    outputs: Metadata

    @property
    def seeded(self) -> bool:
        return any(kind == "seed" for kind, _ in self.sources)

    def arguments(self, inputs: Sequence[Any], constants: Sequence[Any], seed: Any, builder: Any) -> list:
        """The XLA ops to call ``computation`` with, from ops for the inputs, the constants
        and the seed (``builder`` makes the literals)."""
        import torch_xla.core.xla_builder as xb

        def argument(kind: str, value: Any) -> Any:
            if kind == "input":
                return inputs[value]
            if kind == "literal":
                return xb.Op.constant(builder, value)
            if kind == "constant":
                return constants[value]
            return seed

        return [argument(kind, value) for kind, value in self.sources]


def stage(fn: Callable, inputs: Metadata, *, name: str = "staged", what: str | None = None) -> Staged:
    """``fn(*placeholders)`` (tensors out) staged once into one XLA computation named
    ``name``; ``what`` (default ``name``) names ``fn`` in errors."""
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model as xm

    # The RNG seed is found below by its node id, which is the device's root seed only while
    # no random op is pending since the last sync; after one, a random op here reads a seed
    # composed from it, the root seed would be staged as a constant, and every call would
    # draw the same numbers. Setting the running seed again (the same stream: later draws
    # are unchanged) makes the next draw read a fresh root seed.
    xm.set_rng_state(xm.get_rng_state())
    placeholders = [xb.create_placeholder_tensor(shape, dtype) for shape, dtype in inputs]
    outputs = list(_with_scalars_as_constants(fn, placeholders))
    for position, value in enumerate(outputs):
        # torch_xla crashes the process on anything but tensors here: refuse first.
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{what or name}: must return tensors, got a {type(value).__name__} at position {position}"
            )
    context = torch_xla._XLAC.lowering.LoweringContext("FnComputation")
    context.build(outputs)
    computation = xb.computation_from_module_proto(name, context.hlo())

    source: dict[int, tuple[str, Any]] = {}
    for position, placeholder in enumerate(placeholders):
        parameter = context.tensor_parameter_id(placeholder)
        if parameter != -1:
            source[parameter] = ("input", position)
    seed_parameter = -1
    node_ids, node_values = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    seed_id = torch_xla._XLAC._get_seed_info_id()
    if seed_id in node_ids:
        seed_parameter = context.tensor_parameter_id(node_values[node_ids.index(seed_id)])
    constants: list[torch.Tensor] = []
    for parameter, tensor in context.device_parameter_id_tensor_mapping().items():
        if parameter in source:
            continue
        if parameter == seed_parameter:
            source[parameter] = ("seed", None)
        elif tensor.numel() <= LITERAL_ELEMENTS:
            source[parameter] = ("literal", tensor.cpu())
        else:
            source[parameter] = ("constant", len(constants))
            constants.append(tensor)
    return Staged(
        name, computation, tuple(source[p] for p in range(len(source))), tuple(constants), inputs, metadata(outputs)
    )


@dataclasses.dataclass(frozen=True)
class _Call:
    """A staged computation wrapped to take ``(*inputs, *constants, [seed])`` operands."""

    staged: Staged
    computation: Any


def _caller(staged: Staged) -> _Call:
    import torch_xla.core.xla_builder as xb

    def shape(dims: Sequence[int], dtype: torch.dtype) -> Any:
        return xb.mkshape(xb.Op.from_torch_type(dtype), list(dims))

    shapes = [
        *(shape(s, d) for s, d in staged.inputs),
        *(shape(t.shape, t.dtype) for t in staged.constants),
    ]
    if staged.seeded:
        shapes.append(shape((), torch.int64))
    builder = xb.create_builder(f"{staged.name}_call")
    params = [xb.mkparam(builder, i, s) for i, s in enumerate(shapes)]
    count = len(staged.inputs)
    inputs, constants = params[:count], params[count : count + len(staged.constants)]
    seed = params[-1] if staged.seeded else None
    result = xb.Op.call(staged.computation, staged.arguments(inputs, constants, seed, builder))
    outputs = [result.get_tuple_element(i) for i in range(len(staged.outputs))]
    return _Call(staged, xb.Op.tuple(outputs).build(f"{staged.name}_call"))


class StagedFunction:
    """``fn`` staged once per input shapes and dtypes, then called by binding tensors.

    Calls take and return XLA tensors; nothing is copied or moved. The computation is
    specific to the shapes and dtypes of the inputs, not to their values or shardings.
    """

    def __init__(self, fn: Callable, *, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.calls: dict[Metadata, _Call] = {}

    def __call__(self, *tensors: torch.Tensor, key: Metadata | None = None) -> list[torch.Tensor]:
        """``key``: ``metadata(tensors)``, when the caller knows it."""
        import torch_xla

        key = metadata(tensors) if key is None else key
        call = self.calls.get(key)
        if call is None:
            call = self.calls[key] = _caller(stage(self.fn, key, name=self.name))
        operands = [*tensors, *call.staged.constants]
        if call.staged.seeded:
            device = tensors[0].device if tensors else torch_xla.device()
            operands.append(torch.randint(0, 2**62, (), dtype=torch.int64, device=device))
        if not call.staged.outputs:
            return []
        return list(torch_xla._XLAC._xla_user_computation(f"hops_xla::{self.name}", operands, call.computation))


def _literal(value: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A host tensor's value as an XLA tensor made of constants (no device data: nothing is
    transferred), or None where it is too large or of a dtype a Python number cannot hold."""
    if value.numel() > LITERAL_ELEMENTS or value.is_complex() or value.layout != torch.strided:
        return None
    numbers = value.reshape(-1).tolist()  # a host read: value is on the host
    dtype = value.dtype
    if dtype == torch.bool:  # torch_xla makes a bool fill value device data: built as integers
        numbers, dtype = [int(number) for number in numbers], torch.int32
    if all(number == numbers[0] for number in numbers) or not numbers:
        literal = torch.full(value.shape, numbers[0] if numbers else 0, dtype=dtype, device=device)
    else:
        parts = [torch.full((), number, dtype=dtype, device=device) for number in numbers]
        literal = torch.stack(parts).reshape(value.shape)
    return literal.to(value.dtype)


# ``_to_copy`` arguments other than the device and dtype, and the values that keep a copy a
# plain copy of the values.
_PLAIN_COPY = {
    "layout": (None, torch.strided),
    "pin_memory": (None, False),
    "memory_format": (None, torch.preserve_format, torch.contiguous_format),
}


def _host_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and not isinstance(value, torch.nn.Parameter)


class _HostValuesAsLiterals:
    """While staging: a host tensor that meets a device (copied to it, or a 0-dim operand of
    an op on device tensors) becomes a literal of the computation instead of device data.

    torch_xla would upload it (``TransferToDevice``) and hoist it as a parameter, which
    ``stage`` would read back (``TransferFromDevice``) to write it as a literal. Built as a
    ``TorchDispatchMode`` class on first use (torch imported lazily like the rest of staging).
    Ops inside a higher-order operator's body run outside the mode (a HOP left in a step
    staged without SPMD): their constants take the hoisting path."""

    _mode_type: Any = None

    @classmethod
    def mode(cls) -> Any:
        if cls._mode_type is None:
            from torch.utils._python_dispatch import TorchDispatchMode
            from torch.utils._pytree import tree_flatten, tree_unflatten

            class Mode(TorchDispatchMode):
                supports_higher_order_operators = True

                def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                    kwargs = kwargs or {}
                    if isinstance(func, torch._ops.HigherOrderOperator):
                        return func(*args, **kwargs)
                    if func is torch.ops.aten._to_copy.default and _host_tensor(args[0]):
                        device = kwargs.get("device")
                        if device is not None and torch.device(device).type == "xla":
                            if all(kwargs.get(k) in plain for k, plain in _PLAIN_COPY.items()):
                                value = args[0].to(kwargs.get("dtype") or args[0].dtype)
                                literal = _literal(value, torch.device(device))
                                if literal is not None:
                                    return literal
                    flat, spec = tree_flatten((args, kwargs))
                    device = next((a.device for a in flat if isinstance(a, torch.Tensor) and a.device.type == "xla"), None)
                    if device is not None:
                        changed = False
                        for i, value in enumerate(flat):
                            if _host_tensor(value) and value.dim() == 0:
                                literal = _literal(value, device)
                                if literal is not None:
                                    flat[i], changed = literal, True
                        if changed:
                            args, kwargs = tree_unflatten(flat, spec)
                    return func(*args, **kwargs)

            cls._mode_type = Mode
        return cls._mode_type()


def _with_scalars_as_constants(fn: Callable, inputs: Sequence[torch.Tensor]) -> Any:
    """``fn(*inputs)`` staged with every Python number, and every host value that meets the
    device (``_HostValuesAsLiterals``), as an XLA constant.

    By default torch_xla makes a number other than 0 and 1 device data, cached by value and
    shared by every op that uses it: a parameter. One such scalar used both inside a
    manual-sharding region and outside it (``x.pow(2)``'s backward multiplies by 2.0, as a
    region body doing ``local * 2`` does) gets one sharding for both uses, and XLA's
    sharding propagation aborts the process (``hlo_sharding.h: Check failed: IsTiled()``).
    A constant belongs to each op that uses it."""
    import torch_xla

    before = torch_xla._XLAC._get_xla_all_numbers_special_scalars()
    torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)
    try:
        with _HostValuesAsLiterals.mode():
            return fn(*inputs)
    finally:
        torch_xla._XLAC._set_xla_all_numbers_special_scalars(before)
