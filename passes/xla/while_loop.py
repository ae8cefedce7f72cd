"""One XLA ``While`` from a step function, staged once per step and input layout.

``xla_while(body, carry, xs, additional, length=, reverse=, unroll=)`` runs
``body(*carry, *x, *additional) -> (*new_carry, *y)`` for each slice ``x`` of ``xs`` along
dim 0 inside one XLA ``While`` and returns ``(*final_carry, *ys)``. The step is staged on
placeholder tensors into one XLA computation that the loop body calls ``unroll`` times per
iteration (as JAX's ``scan(unroll=k)``: ``length // unroll`` iterations, then the
``length % unroll`` remaining steps after the loop); the built loop is cached per (step,
input shapes and dtypes, length, reverse, unroll), so later calls only bind tensors.

The loop state is ``(step index, *carry, *xs, *ys, *additional, *constants, [seeds])``. Values
torch_xla stages as parameters although the step does not take them ("hoisted": the device
data it makes for Python scalars, lifted constants, the RNG seed) are handled so that none
of them is a loop operand the step could use inside a manual-sharding region:
- constants of at most ``LITERAL_ELEMENTS`` elements become literals of the loop body.
  A hoisted scalar that a ``local_map`` body uses (``local * 2``) would otherwise be a loop
  operand that sharding propagation marks ``{manual}``; XLA cannot reshard the replicated
  value entering the loop to that and aborts (``hlo_sharding.cc: Check failed:
  !IsManual()``). Literals never cross the loop boundary (as in JAX);
- larger constants are loop-invariant operands;
- the RNG seed becomes one fresh seed per step, so each step draws different numbers.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import torch

from hops._subgraph import body_name

#: Hoisted constants up to this many elements are written into the loop body as literals.
LITERAL_ELEMENTS = 64


@dataclasses.dataclass(frozen=True)
class _Loop:
    """A built loop: its computation and what to bind besides the caller's tensors."""

    computation: Any
    y_metadata: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    constants: tuple[torch.Tensor, ...]  # loop-invariant operands after the additional inputs
    seeded: bool  # the step reads the RNG seed: one seed per step is the last operand


# step -> {(layout, length, reverse): _Loop}; weak, so a dropped GraphModule drops its loops.
_LOOPS: weakref.WeakKeyDictionary[Callable, dict[tuple, _Loop]] = weakref.WeakKeyDictionary()


def _metadata(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def xla_while(
    body: Callable,
    carry: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    additional: Sequence[torch.Tensor],
    *,
    length: int,
    reverse: bool = False,
    unroll: int = 1,
) -> tuple[torch.Tensor, ...]:
    """``(*final_carry, *ys)`` of ``length`` steps of ``body`` in one XLA ``While`` that runs
    ``unroll`` steps per iteration."""
    import torch_xla

    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise TypeError(f"xla_while: unroll must be an int >= 1, got {unroll!r}")
    unroll = min(unroll, max(length, 1))
    key = (_metadata(carry), _metadata(xs), _metadata(additional), length, reverse, unroll)
    try:
        loops = _LOOPS.setdefault(body, {})
    except TypeError:  # not weak-referenceable: build every call
        loops = {}
    # A GraphModule changed after a call (recompiled) is a new step.
    code = getattr(body, "code", None)
    loop = loops.get((key, code))
    if loop is None:
        loop = loops[(key, code)] = _build(body, carry, xs, additional, length, reverse, unroll)
    given = [*carry, *xs, *additional]
    device = given[0].device if given else torch_xla.device()
    operands = [
        torch.zeros((), dtype=torch.int64, device=device),  # the step index
        *carry,
        *xs,
        *(torch.zeros((length, *shape), dtype=dtype, device=device) for shape, dtype in loop.y_metadata),
        *additional,
        *loop.constants,
    ]
    if loop.seeded:
        operands.append(torch.randint(0, 2**62, (length,), dtype=torch.int64, device=device))
    state = torch_xla._XLAC._xla_user_computation("hops_xla::scan", operands, loop.computation)
    num_carry, num_xs, num_ys = len(carry), len(xs), len(loop.y_metadata)
    ys_start = 1 + num_carry + num_xs
    return (*state[1 : 1 + num_carry], *state[ys_start : ys_start + num_ys])


def _build(
    body: Callable,
    carry: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    additional: Sequence[torch.Tensor],
    length: int,
    reverse: bool,
    unroll: int,
) -> _Loop:
    import torch_xla
    import torch_xla.core.xla_builder as xb

    # 1. Stage one step on placeholders (tensors with a shape and no data).
    inputs = [
        *(xb.create_placeholder_tensor(tuple(t.shape), t.dtype) for t in carry),
        *(xb.create_placeholder_tensor(tuple(t.shape[1:]), t.dtype) for t in xs),
        *(xb.create_placeholder_tensor(tuple(t.shape), t.dtype) for t in additional),
    ]
    outputs = list(_with_scalars_as_constants(body, inputs))
    num_carry, num_xs = len(carry), len(xs)
    _check_step_outputs(body_name(body), outputs, carry)
    ys = outputs[num_carry:]
    context = torch_xla._XLAC.lowering.LoweringContext("FnComputation")
    context.build(outputs)
    step = xb.computation_from_module_proto(f"{body_name(body)}_step", context.hlo())

    # 2. Where each parameter of the staged step comes from.
    source: dict[int, tuple[str, Any]] = {}
    for position, placeholder in enumerate(inputs):
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

    # 3. The loop: state (index, *carry, *xs, *ys, *additional, *constants, [seeds]).
    ys_start = 1 + num_carry + num_xs
    additional_start = ys_start + len(ys)
    constants_start = additional_start + len(additional)
    seeds_position = constants_start + len(constants)

    def shape(dims: Sequence[int], dtype: torch.dtype) -> Any:
        return xb.mkshape(xb.Op.from_torch_type(dtype), list(dims))

    state_shapes = [
        shape((), torch.int64),
        *(shape(t.shape, t.dtype) for t in carry),
        *(shape(t.shape, t.dtype) for t in xs),
        *(shape((length, *y.shape), y.dtype) for y in ys),
        *(shape(t.shape, t.dtype) for t in additional),
        *(shape(t.shape, t.dtype) for t in constants),
    ]
    if seed_parameter != -1:
        state_shapes.append(shape((length,), torch.int64))
    builder = xb.create_builder("scan")
    state = [xb.mkparam(builder, i, s) for i, s in enumerate(state_shapes)]

    def condition(index: Any, *rest: Any) -> Any:
        # Another iteration only while all of its ``unroll`` steps are in range. The bound is
        # a multiple of the increment: XLA's loop simplifier (in torch_xla 2.9) floors
        # (bound - start) / increment as the trip count and deletes ``i < 1; i += 3``.
        return index < xb.Op.scalar(index.builder(), length // unroll * unroll, dtype=xb.Type.S64)

    def one_step(state: list, offset: int) -> list:
        """``state`` after the step ``state[0] + offset`` (the index itself is not advanced)."""
        index = state[0]
        if offset:
            index = index + xb.Op.scalar(index.builder(), offset, dtype=xb.Type.S64)
        position = xb.Op.scalar(index.builder(), length - 1, dtype=xb.Type.S64) - index if reverse else index
        slices = [_slice(state[1 + num_carry + i], position) for i in range(num_xs)]
        step_inputs = [*state[1 : 1 + num_carry], *slices, *state[additional_start:constants_start]]

        def argument(parameter: int) -> Any:
            kind, value = source[parameter]
            if kind == "input":
                return step_inputs[value]
            if kind == "literal":
                return xb.Op.constant(index.builder(), value)
            if kind == "constant":
                return state[constants_start + value]
            return _slice(state[seeds_position], position)  # this step's seed

        result = xb.Op.call(step, [argument(p) for p in range(len(source))])
        state = list(state)
        for i in range(num_carry):
            state[1 + i] = result.get_tuple_element(i)
        for j in range(len(ys)):
            state[ys_start + j] = _update_slice(state[ys_start + j], result.get_tuple_element(num_carry + j), position)
        return state

    def loop_body(index: Any, *rest: Any) -> tuple:
        state = [index, *rest]
        for offset in range(unroll):
            state = one_step(state, offset)
        # One increment by the step count: the induction variable stays ``i += k``, the
        # form XLA's loop analyses recognize (a chain of ``+1``s makes them miscount).
        state[0] = index + xb.Op.scalar(index.builder(), unroll, dtype=xb.Type.S64)
        return tuple(state)

    loop = xb.Op.mkwhile(state, condition, loop_body)
    remainder = length % unroll
    if remainder:
        state = [loop.get_tuple_element(i) for i in range(len(state_shapes))]
        for offset in range(remainder):
            state = one_step(state, offset)
        loop = xb.Op.tuple(state)

    computation = loop.build("scan")
    return _Loop(computation, _metadata(ys), tuple(constants), seed_parameter != -1)


def _with_scalars_as_constants(body: Callable, inputs: Sequence[torch.Tensor]) -> Any:
    """``body(*inputs)`` staged with every Python number as an XLA constant.

    By default torch_xla makes a number other than 0 and 1 device data, cached by value and
    shared by every op that uses it: a step parameter. One such scalar used both inside a
    manual-sharding region and outside it (``x.pow(2)``'s backward multiplies by 2.0, as a
    region body doing ``local * 2`` does) gets one sharding for both uses, and XLA's
    sharding propagation aborts the process (``hlo_sharding.h: Check failed: IsTiled()``).
    A constant belongs to each op that uses it."""
    import torch_xla

    before = torch_xla._XLAC._get_xla_all_numbers_special_scalars()
    torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)
    try:
        return body(*inputs)
    finally:
        torch_xla._XLAC._set_xla_all_numbers_special_scalars(before)


def _check_step_outputs(name: str, outputs: Sequence[Any], carry: Sequence[torch.Tensor]) -> None:
    # torch_xla crashes the process on anything but tensors here: refuse first.
    for position, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"xla_while: step {name}: must return (*new_carry, *ys) as tensors, "
                f"got a {type(value).__name__} at position {position}"
            )
    if len(outputs) < len(carry):
        raise ValueError(f"xla_while: step {name}: returned {len(outputs)} tensors for {len(carry)} carries")
    for i, (new, old) in enumerate(zip(outputs, carry)):
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(
                f"xla_while: step {name}: carry {i} leaves the step as {tuple(new.shape)} {new.dtype}, "
                f"entered as {tuple(old.shape)} {old.dtype}"
            )


def _start_indices(array: Any, position: Any) -> list:
    return [position, *(position.zeros_like() for _ in range(array.shape().rank - 1))]


def _slice(array: Any, position: Any) -> Any:
    """``array[position]`` (dim 0) of an XLA op."""
    sizes = list(array.shape().sizes)
    return array.dynamic_slice(_start_indices(array, position), [1, *sizes[1:]]).reshape(sizes[1:])


def _update_slice(array: Any, value: Any, position: Any) -> Any:
    """``array`` with ``array[position] = value`` (dim 0), of XLA ops."""
    return array.dynamic_update_slice(value.broadcast([1]), _start_indices(array, position))
