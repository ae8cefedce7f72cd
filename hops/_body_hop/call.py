"""``call_body_hop``: how a public function calls a body HOP. It refuses operands on
different devices (naming them by key path), inspects the body once on fake stand-ins
(refusing writes into what it does not own) and, where a tracer or XLA needs them as
inputs, lifts the tensors the body closes over. Under Dynamo it hands the HOP the call's
description instead (``call_description``), which the HOP's Dynamo variable reads and
with which a call Dynamo broke the graph at runs this again (``hops._dynamo``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from hops._body_hop.autograd import needs_traced_autograd
from hops._body_hop.body import describe_tensor, inspect_body, lift_closure, unwrap_functional
from hops._body_hop.body_record import body_record, known_functional, lifted_plan_key, update_record
from hops._body_hop.caches import cached_per_trace
from hops._body_hop.code_key import CodeKey
from hops._body_hop.subgraph import body_name

__all__ = [
    "CALL_DESCRIPTION", "CalledHop", "DeviceMismatchError", "argument_names", "call_body_hop", "call_description",
    "check_one_device",
]


class CalledHop(Protocol):
    """What ``call_body_hop`` needs of a HOP (``hops._body_hop.base.BodyHOP`` has it)."""

    collectives_refusal: str | None

    def __call__(self, body: Callable, *operands_and_spec: Any) -> Any: ...

    def check(self, body: Callable, operands: Sequence[Any], spec: Any) -> None: ...

    def body_inputs(self, operands: Sequence[Any], spec: Any) -> tuple: ...

    def fold_lifted(self, operands: Sequence[Any], spec: Any, lifted: Sequence[Any]) -> tuple[list, Any]: ...


CALL_DESCRIPTION = "hops.call_description"


def call_description(name: str, what: str, input_names: Sequence[str]) -> tuple:
    """What a public function tells its HOP's variable about the call, passed after the spec
    under Dynamo only (never a node arg): the user function's name, the call as eager's errors
    name it (``"local_map(block)"``) and the name of each input (``"leaf 0"``)."""
    return (CALL_DESCRIPTION, name, what, tuple(input_names))


def _refuse_untraced_closure(closed: Sequence[torch.Tensor], operands: Sequence[Any], what: str, user_function: Any) -> None:
    """A fake-tensor trace cannot take a real tensor the body reads from its closure: as a
    constant of the graph it would silently get no gradient. Refused as plain torch code
    refuses it, with the way out."""
    if not any(isinstance(unwrap_functional(o), FakeTensor) for o in operands if isinstance(o, torch.Tensor)):
        return
    for tensor in closed:
        if not isinstance(unwrap_functional(tensor), FakeTensor) and tensor.device.type != "meta":
            raise TypeError(
                f"{what}: the body reads {describe_tensor(tensor, user_function)} from outside its "
                "inputs, a real tensor the fake-tensor tracer does not know (as a constant it would get "
                "no gradient); pass it as an input (torch.func.functional_call, aot_module), or trace "
                "with torch.compile / torch.export, which lift parameters themselves"
            )


class DeviceMismatchError(ValueError, RuntimeError):
    """The operands of a body HOP are on different devices. A ``ValueError``, and a
    ``RuntimeError`` as torch's own device-mismatch errors are."""


def check_one_device(operands: Sequence[Any], what: str, names: Callable[[int], str]) -> None:
    """Every tensor operand is on one device, as one step of the body needs them (else torch
    fails deep inside the body, or a fake-tensor run with a device-propagation error). A 0-d
    CPU tensor goes with any device, as in torch's ops (a Python number in a scan's init
    becomes one)."""
    # Read without torch-function modes: an enclosing body's inspection records the tensors
    # a body reads (in first-read order, which orders its lifted inputs); this is no read.
    with torch._C.DisableTorchFunction():
        devices = [(i, value.device, value.dim()) for i, value in enumerate(operands) if isinstance(value, torch.Tensor)]
    devices = [(i, device) for i, device, rank in devices if not (rank == 0 and device.type == "cpu")]
    for i, device in devices[1:]:
        if device != devices[0][1]:
            raise DeviceMismatchError(
                f"{what}: {names(devices[0][0])} is on {devices[0][1]} but {names(i)} is on {device}; "
                "every tensor must be on one device"
            )


def argument_names(args: Sequence[Any], kwargs: dict) -> list[str]:
    """A name per leaf of ``tree_flatten((args, kwargs))`` by its key path: ``args[1]``,
    ``args[0]['w']``, ``kwargs['mask']``."""
    paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    return [("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(tuple(path[1:])) for path, _ in paths]


def call_body_hop(
    hop: CalledHop,
    body: Callable,
    operands: Sequence[Any],
    spec: Any,
    *,
    what: str,
    input_names: Callable[[int], str],
    user_function: Any,
    device_names: Callable[[int], str] | None = None,
) -> Any:
    """Call ``hop`` the way a public function does: refuse operands on different devices,
    inspect the body once (refusing writes into what it does not own), and where a tracer
    or XLA needs them as inputs, lift the tensors it closes over. Under Dynamo, which lifts
    and checks bodies itself, just call it. ``device_names(i)`` names operand ``i`` in a
    device error (default ``input_names``). The results come in the structure the body
    returns."""
    if torch.compiler.is_dynamo_compiling():
        # The variable checks the call as below and names it as eager's errors do.
        names = tuple(input_names(i) for i in range(len(operands)))
        return hop(body, *operands, spec, call_description(body_name(user_function), what, names))
    hop.check(body, operands, spec)
    check_one_device(operands, what, device_names or input_names)
    traced = needs_traced_autograd(operands)
    def inspect() -> Any:
        with disable_proxy_modes_tracing():
            examples = hop.body_inputs(operands, spec)
        refusal = None if hop.collectives_refusal is None else hop.collectives_refusal.replace("{what}", what)
        return inspect_body(
            body, examples, what=what, input_names=input_names, user_function=user_function, eager=not traced,
            refuse_collectives=refusal,
        )

    info = cached_per_trace("inspection", inspect, body, operands, spec) if traced else inspect()
    if not info.complete:
        # The body reads tensor values in Python: it runs for real only, uninspected.
        return hop(body, *operands, spec)
    body = known_functional(body)
    if traced and info.closed:
        _refuse_untraced_closure(info.closed, operands, what, user_function)
        record, read = body_record(body), info.read
        code_key_of = record.code_key
        body = update_record(
            lift_closure(body, len(operands), read),
            known_functional=True,
            trace_key=None if record.trace_key is None else (record.trace_key, tuple(id(t) for t in read)),
            code_key=None if code_key_of is None else functools.cache(lambda: _with_lifted(code_key_of(), read)),
            plan_key=lifted_plan_key(body, read),
        )
        operands, spec = hop.fold_lifted(operands, spec, tuple(info.closed))
    return hop(body, *operands, spec)


def _with_lifted(key: CodeKey | None, read: Sequence[torch.Tensor]) -> CodeKey | None:
    """The code key of a body whose closure tensors ``read`` became trailing inputs: none
    unless the key was built from those tensors (else they were reached through something
    the key does not hold, which may change between calls)."""
    if key is None or not all(id(t) in key.tensors for t in read):
        return None
    lifted = CodeKey((key, tuple(id(t) for t in read)))
    lifted.tensors = key.tensors
    return lifted
