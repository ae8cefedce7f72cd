"""Device rules of lowering targets, loaded when a HOP first meets a tensor of their device.

A lowering target may register a HOP's eager rule for its device's dispatch key: on XLA
tensors a scan runs as one XLA While and an annotation attaches its XLA sharding
(``passes``). ``hops`` never imports a target. A target declares itself as an entry point
of the group ``hops.device_targets`` (name: the device type, value: the module whose import
registers its rules), and the first HOP call that sees a tensor of that device imports it.
Without an installed target a HOP runs its reference semantics on that device.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Iterable

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
