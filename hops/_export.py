"""``torch.export.save`` / ``load`` of programs holding this package's HOPs.

What the package writes, in torch's export schema:
- a spec argument: an operator name ``#hops:<the spec's text>``, read back as the typed spec;
- a node's tuple of bodies (a ``local_map`` with alternatives, one body per alternative): a
  ``#hops:bodies=<count>`` marker followed by each body as its own subgraph argument, read
  back as the tuple;
- a HOP's target: ``#hops:torch.ops.higher_order.<name>``, read back as the HOP.

Every ``#hops:`` name is read by the namespace ``hops`` registered with torch's serializer at
import, a registration and nothing more. Writing, and regrouping a tuple of bodies on
reading, wrap methods of torch's serializer (``_compat.EXPORT_PATCHES`` says which, and
why): installed by ``ensure_serializer``, the first time a HOP node is recorded under
``torch.export`` (``note_recorded``) or a saved program's HOP is read back, never at import.
"""

from __future__ import annotations

from typing import Any

import torch

from hops import _compat
from hops.specs import _FxLiteral, spec_from_text

_HOP_PREFIX = "torch.ops.higher_order."
_BODIES_PREFIX = "bodies="


class _Bodies:
    """The marker written before a node's tuple of ``count`` bodies."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count


def _is_package_hop(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator) and type(target).__module__.split(".")[0] == "hops"


def _is_bodies(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) > 0
        and all(isinstance(v, torch.fx.Node) and v.op == "get_attr" for v in value)
    )


def _name_of(value: Any) -> str | None:
    """The ``#hops:`` name ``value`` is written as, or None when torch writes it itself."""
    if isinstance(value, _FxLiteral):
        return repr(value)
    if isinstance(value, _Bodies):
        return f"{_BODIES_PREFIX}{value.count}"
    if _is_package_hop(value):
        return f"{_HOP_PREFIX}{value.__name__}"
    return None


def _value_of(name: str) -> Any:
    """The value written as ``#hops:<name>`` (``_name_of``'s inverse)."""
    if name.startswith(_HOP_PREFIX):
        hop = _compat.registered_hop(name[len(_HOP_PREFIX) :])
        if hop is None:
            raise ValueError(
                f"the saved program calls {name}, which is not registered: define its kernel "
                "(import the module that does) before torch.export.load"
            )
        ensure_serializer()  # this node's tuple of bodies, if any, is read next
        return hop
    if name.startswith(_BODIES_PREFIX):
        return _Bodies(int(name[len(_BODIES_PREFIX) :]))
    return spec_from_text(name)


def _flatten(args: Any) -> Any:
    """A node's arguments as written: each tuple of bodies as its marker and its bodies."""
    if not any(_is_bodies(a) for a in args):
        return args
    flat: list[Any] = []
    for arg in args:
        flat.extend([_Bodies(len(arg)), *arg] if _is_bodies(arg) else [arg])
    return flat


def _regroup(args: tuple) -> tuple:
    """A node's arguments as read back: each marker and the bodies after it as one tuple."""
    if not any(isinstance(a, _Bodies) for a in args):
        return args
    grouped: list[Any] = []
    values = iter(args)
    for value in values:
        grouped.append(tuple(next(values) for _ in range(value.count)) if isinstance(value, _Bodies) else value)
    return tuple(grouped)


def register() -> None:
    """At import: the namespace ``hops`` with torch's serializer (a registration only)."""
    _compat.register_export_namespace(_value_of)


_installed = False


def ensure_serializer() -> None:
    global _installed
    if not _installed:
        _compat.install_export_serializer(_name_of, _flatten, _regroup)
        _installed = True


def note_recorded() -> None:
    """Called where a HOP node is recorded: under ``torch.export`` the program may be saved."""
    if not _installed and torch.compiler.is_exporting():
        ensure_serializer()
