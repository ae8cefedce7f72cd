"""One XLA ``While`` from a step function, staged once per step and input layout.

``xla_while(body, carry, xs, additional, length=, reverse=, unroll=)`` runs
``body(*carry, *x, *additional) -> (*new_carry, *y)`` for each slice ``x`` of ``xs`` along
dim 0 inside one XLA ``While`` and returns ``(*final_carry, *ys)``. The step is staged on
placeholder tensors into one XLA computation that the loop body calls ``unroll`` times per
iteration (as JAX's ``scan(unroll=k)``: ``length // unroll`` iterations, then the
``length % unroll`` remaining steps after the loop); the built loop is cached per (step,
input shapes and dtypes, length, reverse, unroll), so later calls only bind tensors.

The step is staged by ``staging.stage`` (which says how values torch_xla hoists into
parameters are handled). The loop state is ``(counter, *carry, *xs, *ys, *additional,
*constants, [seeds])``: small constants are literals of the loop body, larger ones
loop-invariant operands, and the RNG seed one fresh seed per step, so each step draws
different numbers. A call moves no data between host and device: its operands are the
caller's device tensors, the constants (device data since staging) and the seeds (drawn on
the device); the ys buffers start as zeros made by the computation itself.

What XLA compiles is kept to what the loop needs, since on XLA:CPU each kernel is an LLVM
compile (the bulk of a scan's compile time) and identical fused kernels are compiled once:
- the counter is the position the iteration reads and writes: 0 up in a forward loop,
  ``length - 1`` down in a reverse one, starting as a literal. Slices index by the loop
  value itself in both directions, so a scan's backward (a reverse scan over the forward's
  inputs) reuses the forward's slice kernels; ``length - 1 - index`` (or a second counter,
  which XLA folds back into that) fused into every slice makes each a new kernel;
- the computation returns the carries and ys only.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import torch

from hops.lowering import body_name
from passes.xla.portable import refuse_host_only_ops
from passes.xla.staging import Metadata, metadata, stage


@dataclasses.dataclass(frozen=True)
class _Loop:
    """A built loop: its computation and what to bind besides the caller's tensors."""

    computation: Any
    y_metadata: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    constants: tuple[torch.Tensor, ...]  # loop-invariant operands after the additional inputs
    seeded: bool  # the step reads the RNG seed: one seed per step is the last operand


# step -> {(layout, length, reverse): _Loop}; weak, so a dropped GraphModule drops its loops.
_LOOPS: weakref.WeakKeyDictionary[Callable, dict[tuple, _Loop]] = weakref.WeakKeyDictionary()


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
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*carry, *xs, *additional)):
        # Its results would not require grad: every gradient through the loop would be
        # silently missing (None), not an error.
        raise RuntimeError(
            "xla_while: a scan lowered to an XLA While has no autograd rule, and an input requires grad: "
            "lower the forward and backward graphs AOTAutograd produces (torch.compile(backend='hops_xla') "
            "does), or run the lowered graph under torch.no_grad()"
        )
    unroll = min(unroll, max(length, 1))
    key = (metadata(carry), metadata(xs), metadata(additional), length, reverse, unroll)
    try:
        loops = _LOOPS.setdefault(body, {})
    except TypeError:  # not weak-referenceable: build every call
        loops = {}
    # A GraphModule changed after a call (recompiled) is a new step.
    code = getattr(body, "code", None)
    loop = loops.get((key, code))
    if loop is None:
        if isinstance(body, torch.fx.GraphModule):  # checked once per loop built, not per run
            refuse_host_only_ops(body, f"xla_while: the scan body {body_name(body)!r}")
        loop = loops[(key, code)] = _build(body, carry, xs, additional, length, reverse, unroll)
    given = [*carry, *xs, *additional]
    device = given[0].device if given else torch_xla.device()
    operands = [
        *carry,
        *xs,
        *additional,
        *loop.constants,
    ]
    if loop.seeded:
        operands.append(torch.randint(0, 2**62, (length,), dtype=torch.int64, device=device))
    state = torch_xla._XLAC._xla_user_computation("hops_xla::scan", operands, loop.computation)
    num_carry, num_ys = len(carry), len(loop.y_metadata)
    return (*state[:num_carry], *state[num_carry : num_carry + num_ys])


def _build(
    body: Callable,
    carry: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    additional: Sequence[torch.Tensor],
    length: int,
    reverse: bool,
    unroll: int,
) -> _Loop:
    import torch_xla.core.xla_builder as xb

    step = _stage_step(body, carry, xs, additional)
    ys = step.outputs[len(carry) :]
    layout = _State.of(len(carry), len(xs), len(ys), len(additional), len(step.constants))
    builder = xb.create_builder("scan")
    state = _initial_state(builder, step, carry, xs, additional, ys, length, reverse)
    iterations = length // unroll
    loop = xb.Op.mkwhile(
        state,
        lambda counter, *rest: _another_iteration(counter, length, iterations * unroll, reverse, unroll),
        lambda counter, *rest: _iteration(step, layout, [counter, *rest], reverse, unroll),
    )
    state = [loop.get_tuple_element(i) for i in range(len(state))]
    for offset in range(length % unroll):
        state = _one_step(step, layout, state, offset, reverse)
    # The carries and ys are the results: the caller reads nothing else.
    computation = xb.Op.tuple(state[layout.carry : layout.xs] + state[layout.ys : layout.additional]).build("scan")
    return _Loop(computation, tuple(ys), tuple(step.constants), step.seeded)


@dataclasses.dataclass(frozen=True)
class _State:
    """Where each value sits in the loop's state ``(counter, *carry, *xs, *ys, *additional,
    *constants, [seeds])``: each field the position of its group's first value."""

    carry: int
    xs: int
    ys: int
    additional: int
    constants: int
    seeds: int

    @classmethod
    def of(cls, num_carry: int, num_xs: int, num_ys: int, num_additional: int, num_constants: int) -> "_State":
        xs = 1 + num_carry
        ys = xs + num_xs
        additional = ys + num_ys
        constants = additional + num_additional
        return cls(1, xs, ys, additional, constants, constants + num_constants)


def _stage_step(body: Callable, carry: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], additional: Sequence[torch.Tensor]):
    """One step staged on placeholders (tensors with a shape and no data), its outputs checked."""
    step = stage(
        body,
        (*metadata(carry), *((tuple(t.shape[1:]), t.dtype) for t in xs), *metadata(additional)),
        name=f"{body_name(body)}_step",
        what=f"xla_while: step {body_name(body)}: (*new_carry, *ys)",
    )
    _check_step_outputs(body_name(body), step.outputs, carry)
    return step


def _s64(builder: Any, value: int) -> Any:
    import torch_xla.core.xla_builder as xb

    return xb.Op.scalar(builder, value, dtype=xb.Type.S64)


def _initial_state(builder: Any, step: Any, carry, xs, additional, ys, length: int, reverse: bool) -> list:
    """The loop's first state: the computation's parameters are the state without the counter
    and the ys, which start as zeros the computation makes (a buffer from the host would be a
    transfer per call). The counter is the position of the iteration's first step: 0 up, or
    ``length - 1`` down."""
    import torch_xla.core.xla_builder as xb

    def shape(dims: Sequence[int], dtype: torch.dtype) -> Any:
        return xb.mkshape(xb.Op.from_torch_type(dtype), list(dims))

    parameter_shapes = [shape(t.shape, t.dtype) for t in (*carry, *xs, *additional, *step.constants)]
    if step.seeded:
        parameter_shapes.append(shape((length,), torch.int64))
    parameters = [xb.mkparam(builder, i, s) for i, s in enumerate(parameter_shapes)]
    ys_zeros = [
        xb.Op.scalar(builder, 0, dtype=xb.Op.from_torch_type(y_dtype)).broadcast([length, *y_shape]) for y_shape, y_dtype in ys
    ]
    num_given = len(carry) + len(xs)
    return [_s64(builder, length - 1 if reverse else 0), *parameters[:num_given], *ys_zeros, *parameters[num_given:]]


def _another_iteration(counter: Any, length: int, steps_in_loop: int, reverse: bool, unroll: int) -> Any:
    """Whether all of the next iteration's ``unroll`` steps are in range. Forward, the bound is
    a multiple of the increment: XLA's loop simplifier (in torch_xla 2.9) floors (bound -
    start) / increment as the trip count and deletes ``i < 1; i += 3``."""
    if reverse:
        return counter >= _s64(counter.builder(), length - steps_in_loop + unroll - 1)
    return counter < _s64(counter.builder(), steps_in_loop)


def _iteration(step: Any, layout: _State, state: list, reverse: bool, unroll: int) -> tuple:
    """The state after one iteration: ``unroll`` steps, then one increment of the counter by
    the step count (the induction variable stays ``i += k``, the form XLA's loop analyses
    recognize; a chain of ``+1``s makes them miscount)."""
    counter = state[0]
    for offset in range(unroll):
        state = _one_step(step, layout, state, offset, reverse)
    increment = _s64(counter.builder(), unroll)
    state[0] = counter - increment if reverse else counter + increment
    return tuple(state)


def _one_step(step: Any, layout: _State, state: list, offset: int, reverse: bool) -> list:
    """``state`` after the iteration's step ``offset`` (the counter is not advanced)."""
    import torch_xla.core.xla_builder as xb

    counter = state[0]
    position = counter
    if offset:
        shift = _s64(counter.builder(), offset)
        position = counter - shift if reverse else counter + shift
    slices = [_slice(x, position) for x in state[layout.xs : layout.ys]]
    step_inputs = [*state[layout.carry : layout.xs], *slices, *state[layout.additional : layout.constants]]
    seed = _slice(state[layout.seeds], position) if step.seeded else None  # this step's seed
    arguments = step.arguments(step_inputs, state[layout.constants : layout.seeds], seed, counter.builder())
    result = xb.Op.call(step.computation, arguments)
    num_carry = layout.xs - layout.carry
    state = list(state)
    for i in range(num_carry):
        state[layout.carry + i] = result.get_tuple_element(i)
    for j in range(layout.additional - layout.ys):
        state[layout.ys + j] = _update_slice(state[layout.ys + j], result.get_tuple_element(num_carry + j), position)
    return state


def _check_step_outputs(name: str, outputs: Metadata, carry: Sequence[torch.Tensor]) -> None:
    if len(outputs) < len(carry):
        raise ValueError(f"xla_while: step {name}: returned {len(outputs)} tensors for {len(carry)} carries")
    for i, ((shape, dtype), old) in enumerate(zip(outputs, carry)):
        if shape != tuple(old.shape) or dtype != old.dtype:
            raise ValueError(
                f"xla_while: step {name}: carry[{i}] leaves the step as {shape} {dtype}, "
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
