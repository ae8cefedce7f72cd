"""Device rules of lowering targets, loaded when a HOP first meets a tensor of their device.

A lowering target may register a HOP's eager rule for its device's dispatch key: on XLA
tensors a scan runs as one XLA While and an annotation attaches its XLA sharding
(``passes``). ``hops`` never imports a target. A target declares itself as an entry point
of the group ``hops.device_targets`` (name: the device type, value: the module whose import
registers its rules), and the first HOP call that sees a tensor of that device imports it.
Without an installed target a HOP runs its reference semantics on that device.

A target may also register how graphs traced by ``hops.assume_pure`` for its device run
(``register_graph_compiler``): on XLA, lowered and staged into one XLA computation.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Iterable

import torch

_COMMON_DEVICES = frozenset({"cpu", "cuda", "meta"})
_LOADED: set[str] = set()


def load_device_rules(values: Iterable[Any]) -> None:
    """Import the targets registered for the devices of the tensors in ``values``, once."""
    for value in values:
        if isinstance(value, torch.Tensor):
            device = value.device.type
            if device not in _COMMON_DEVICES and device not in _LOADED:
                _LOADED.add(device)
                for entry in importlib.metadata.entry_points(group="hops.device_targets"):
                    if entry.name == device:
                        entry.load()


# device type -> (compiler, prepare): how a traced graph runs on that device (``hops.assume_pure``).
_GRAPH_COMPILERS: dict[str, tuple[Callable[[Any, list], Callable], Callable[[], None] | None]] = {}


def register_graph_compiler(
    device: str, compiler: Callable[[Any, list], Callable], *, prepare: Callable[[], None] | None = None
) -> None:
    """Make ``compiler(gm, example_inputs) -> callable`` compile the graphs ``hops.assume_pure``
    traces for tensors of ``device``, ``prepare()`` called before each trace (a target
    registers them when its module is imported)."""
    _GRAPH_COMPILERS[device] = (compiler, prepare)


def graph_compiler(values: Iterable[Any]) -> Callable[[Any, list], Callable] | None:
    """The compiler registered for the device of the tensors in ``values`` (their target
    loaded and prepared first), or None: the graph runs as it is."""
    values = list(values)
    load_device_rules(values)
    devices = {value.device.type for value in values if isinstance(value, torch.Tensor)}
    registered = {_GRAPH_COMPILERS.get(device) for device in devices}
    if len(registered) != 1 or None in registered:
        return None
    compiler, prepare = registered.pop()
    if prepare is not None:
        prepare()
    return compiler
