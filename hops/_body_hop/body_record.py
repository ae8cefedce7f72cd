"""What this package knows about a body callable, in one typed record: ``body.__hops__``.

The public functions, the shared rules and the device rules hand bodies to one another as
plain callables; what one of them learned about a body travels with it as a frozen
``BodyRecord`` (replaced, never mutated, when something more is learned):

- ``trace_key``: equal keys reuse one inspection within a trace (``set_trace_key``;
  default: the body object itself), and one traced joint unless ``plan_key`` gives one;
- ``plan_key``: computes the key under which equal calls reuse one traced joint within a
  trace: the user function's ``code_key`` with the tensors it reads keyed by their place
  among the lifted inputs (AOTAutograd's two passes call a new closure over new tensor
  wrappers: the same plan), or None;
- ``code_key``: computes the body's ``CodeKey`` (equal eager calls on XLA reuse across calls
  what was made from an equal body), or None;
- ``known_functional``: the body was checked not to write into its inputs (or built by this
  package from a checked graph): no rule traces it again to check;
- ``plan_body``: the body of an autograd plan, made from traced graphs once: it reads no
  Python state, so a device rule may keep what it made from it while its key lives;
- ``graph``: the GraphModule the body runs, when it wraps one (``named``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from hops._body_hop.code_key import CodeKey, code_key

__all__ = [
    "BodyRecord",
    "across_calls_key",
    "body_record",
    "is_known_functional",
    "known_functional",
    "lifted_plan_key",
    "plan_body",
    "plan_body_key",
    "plan_key",
    "set_trace_key",
    "trace_key",
    "traced_graph",
    "typed_values",
    "update_record",
]


@dataclasses.dataclass(frozen=True)
class BodyRecord:
    """What is known about one body; see the module docstring."""

    trace_key: Any = None
    code_key: Callable[[], CodeKey | None] | None = None
    plan_key: Callable[[], Any] | None = None
    user_call: tuple | None = None  # (user function, call structure), from set_trace_key
    known_functional: bool = False
    plan_body: bool = False
    graph: fx.GraphModule | None = None


_NOTHING_KNOWN = BodyRecord()


def body_record(body: Any) -> BodyRecord:
    """The record attached to ``body`` (an empty one if none is)."""
    record = getattr(body, "__hops__", None)
    return record if isinstance(record, BodyRecord) else _NOTHING_KNOWN


def update_record(body: Callable, **changes: Any) -> Callable:
    """Attach ``body``'s record with ``changes`` made; returns ``body``."""
    body.__hops__ = dataclasses.replace(body_record(body), **changes)
    return body


def trace_key(body: Callable) -> Any:
    """The key under which equal calls share an inspection and a plan within a trace."""
    key = body_record(body).trace_key
    return body if key is None else key


def set_trace_key(body: Callable, fn: Callable, *structure: Any, across_calls: bool = True) -> None:
    """Say which user function ``fn`` and call ``structure`` ``body`` runs: equal keys reuse
    one inspection and one traced joint within a fake-mode trace (AOTAutograd's two passes, a
    scan of the same step twice). Eagerly on XLA, calls reuse them across calls by the
    function's ``code_key`` (a new function object with the same code and Python state),
    computed when needed (``across_calls_key``); not with ``across_calls=False``. Nothing is
    set if the structure is not hashable (e.g. a list argument), or under Dynamo (which
    traces bodies itself)."""
    if torch.compiler.is_dynamo_compiling():
        return
    key = (fn, *structure)
    try:
        hash(key)
    except TypeError:
        return
    make = functools.cache(lambda: code_key(fn, *structure)) if across_calls else None  # computed on first use
    user_call = (fn, structure)
    update_record(body, trace_key=key, code_key=make, user_call=user_call, plan_key=_plan_key_maker(user_call, ()))


def typed_values(values: Any) -> tuple:
    """``values`` as a key that tells apart what traces differently though equal in Python:
    ``2`` and ``2.0``, ``True`` and ``1``, ``0.0`` and ``-0.0``."""
    return tuple((type(v), repr(v) if isinstance(v, (float, complex)) else v) for v in values)


def _plan_key_maker(user_call: tuple, lifted: Any) -> Callable[[], Any]:
    """Computes the plan key of a call of ``user_call`` whose closure tensors ``lifted`` are
    trailing inputs (by place: their metadata is the operands'); a tensor it does not read
    cannot change the trace (by metadata). Computed on first use."""
    fn, structure = user_call
    places = {id(t): place for place, t in enumerate(lifted)}

    def tensor_key(t: torch.Tensor) -> Any:
        return ("lifted", places[id(t)]) if id(t) in places else ("unread",)

    return functools.cache(lambda: code_key(fn, *structure, tensor_key=tensor_key))


def lifted_plan_key(body: Callable, lifted: Any) -> Callable[[], Any] | None:
    """The plan key maker of ``body`` once the closure tensors ``lifted`` are its trailing inputs."""
    user_call = body_record(body).user_call
    return None if user_call is None else _plan_key_maker(user_call, lifted)


def plan_key(body: Callable) -> Any:
    """The key under which an equal call shares ``body``'s autograd plan within a trace
    besides its ``trace_key`` (see the module docstring), or None."""
    make = body_record(body).plan_key
    key = make() if make is not None else None
    return None if key is None else ("code", key)


def across_calls_key(body: Callable) -> CodeKey | None:
    """The ``CodeKey`` of ``body``'s user function and call structure, if it has one."""
    make = body_record(body).code_key
    return make() if make is not None else None


def known_functional(body: Callable) -> Callable:
    """Mark a body already checked not to write into its inputs (by ``inspect_body`` or
    because this package built it from a checked graph): later rules need not trace it again
    to check."""
    return update_record(body, known_functional=True)


def is_known_functional(body: Callable) -> bool:
    return body_record(body).known_functional


def plan_body(body: Callable) -> Callable:
    """Mark a body an autograd plan built from traced graphs: it reads no Python state, so a
    device rule may keep what it made from it for as long as the body lives."""
    return update_record(body, plan_body=True, known_functional=True)


def plan_body_key(body: Callable) -> Any:
    """For a body of an autograd plan (``plan_body``: made once, reads no Python state), the
    key under which a device rule may keep what it made from it for as long as the key lives;
    None for any other body."""
    return trace_key(body) if body_record(body).plan_body else None


def traced_graph(body: Callable) -> fx.GraphModule | None:
    """The GraphModule ``body`` runs when this package built it from a traced graph (a
    plan's step): a rule may take it instead of tracing the body again."""
    return body_record(body).graph
