"""What a body HOP call makes once and equal calls reuse: a body's inspection and its
autograd plan. Within one fake-mode trace by the body's trace key (AOTAutograd runs a
function twice); eagerly on XLA tensors across calls by its ``CodeKey`` (bounded, least
recently used evicted)."""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Sequence

import torch
from torch._guards import detect_fake_mode

from hops._body_hop.body import BodyInfo, active_closure_modes, unwrap_functional
from hops._body_hop.body_record import across_calls_key, plan_key, trace_key
from hops._body_hop.code_key import CodeKey

__all__ = ["ACROSS_CALLS_SIZE", "cached_per_trace", "cached_plan"]

# fake mode -> {(kind, body key, operand metadata, spec): inspection or plan}
_PER_TRACE: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
# Eager XLA calls: (kind, CodeKey, operand metadata, spec) -> inspection or plan, least
# recently used first.
_ACROSS_CALLS: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
ACROSS_CALLS_SIZE = 64


class _CachedInspection:
    """A complete ``BodyInfo`` kept across calls without keeping the caller's tensors alive.
    The key holds their ids, so a live tensor found under a key is the one it was built from."""

    def __init__(self, info: BodyInfo) -> None:
        self.closed = [weakref.ref(t) for t in info.closed]
        self.read = [weakref.ref(t) for t in info.read]

    def info(self) -> BodyInfo | None:
        closed, read = [r() for r in self.closed], [r() for r in self.read]
        if any(t is None for t in (*closed, *read)):
            return None
        return BodyInfo(closed, None, True, read)


def _across_calls_key(kind: str, body: Callable, operands: Sequence[Any], spec: Any) -> tuple | None:
    """The key of an eager call on XLA tensors whose body has a ``CodeKey``, else None."""
    metadata = []
    for value in operands:
        if not isinstance(value, torch.Tensor) or value.device.type != "xla":
            return None
        metadata.append((tuple(value.shape), value.dtype, value.device, value.requires_grad))
    code_key = across_calls_key(body)
    return None if code_key is None else (kind, code_key, tuple(metadata), spec)


def _cached_across_calls(kind: str, make: Callable[[], Any], body: Callable, operands: Sequence[Any], spec: Any) -> Any:
    key = _across_calls_key(kind, body, operands, spec)
    if key is None:
        return make()
    entry = _ACROSS_CALLS.get(key)
    value = entry.info() if isinstance(entry, _CachedInspection) else entry
    if value is not None:
        _ACROSS_CALLS.move_to_end(key)
        return value
    value = make()
    if isinstance(value, BodyInfo):
        if not value.complete or not all(id(t) in key[1].tensors for t in value.read):
            return value  # reads values or tensors the key does not hold: inspect every call
        entry = _CachedInspection(value)
    else:
        entry = value
    _ACROSS_CALLS[key] = entry
    while len(_ACROSS_CALLS) > ACROSS_CALLS_SIZE:
        _ACROSS_CALLS.popitem(last=False)
    return value


def _closure_context(code: CodeKey | None) -> tuple:
    """What a body's closure tensors read as where it is called: the closure modes in effect
    (inside an enclosing body, a region in a scan step, they read as that level's stand-ins
    or inputs), for a body that closes over tensors or may (no code key); else nothing."""
    if code is not None and not code.tensors:
        return ()
    return active_closure_modes()


def cached_per_trace(kind: str, make: Callable[[], Any], body: Callable, operands: Sequence[Any], spec: Any) -> Any:
    """``make()``, or what it made for an equal call in the same fake mode (``kind`` names the
    cache: an inspection, an autograd plan). AOTAutograd runs a function twice (metadata,
    then the joint): an equal call is inspected, traced and split once.

    Equal means the same body (or the same trace key, ``hops._body_hop.body_record``: public
    functions make a new body per call around one user function; for a plan, the same plan
    key: a new closure with the same code over tensors in the same places), operand metadata
    and requires_grad, and spec. Eagerly on XLA tensors, a body keyed by ``code_key`` reuses what
    an equal earlier call made (bounded, least recently used evicted). Elsewhere outside a
    fake-tensor trace, or with symbolic shapes, nothing is reused."""
    metadata = []
    for value in operands:
        if not isinstance(value, torch.Tensor):
            return make()
        inner = unwrap_functional(value)
        if not all(isinstance(size, int) for size in inner.shape):
            return make()
        metadata.append((tuple(inner.shape), inner.stride(), inner.dtype, inner.device, value.requires_grad))
    mode = detect_fake_mode([unwrap_functional(v) for v in operands])
    if mode is None:
        return _cached_across_calls(kind, make, body, operands, spec)
    cache = _PER_TRACE.setdefault(mode, {})
    if kind == "inspection":
        # An inspection holds the tensors the body read (the wrappers of one AOTAutograd
        # pass; a module's parameters as functional_call swapped them in): it is reused only
        # under the body's code key, which holds those tensors by identity, never by the
        # function object alone (a bound method reads new parameters under the same key).
        code = across_calls_key(body)
        if code is None:
            return make()
        key = (kind, code, _closure_context(code), tuple(metadata), spec)
        value = cache.get(key)
        if value is None:
            value = cache[key] = make()
        return value
    # Inside an enclosing body (a region in a scan step, both reading one closure tensor),
    # the tensors a body closes over read as that level's stand-ins or inputs: what was made
    # under other closure modes is not reused.
    modes = _closure_context(across_calls_key(body))
    key = (kind, trace_key(body), modes, tuple(metadata), spec)
    value = cache.get(key)
    if value is None:
        code = plan_key(body) if kind == "plan" else None
        if code is None:
            value = cache[key] = make()
        else:
            # The same body, or another closure with the same code and state (a plan only:
            # an inspection holds the tensors the closure reads, the wrappers of one pass).
            alternative = (kind, code, modes, tuple(metadata), spec)
            value = cache.get(alternative)
            if value is None:
                value = cache[alternative] = make()
            cache[key] = value
    return value


def cached_plan(make: Callable[[], Any], body: Callable, operands: Sequence[Any], spec: Any) -> Any:
    return cached_per_trace("plan", make, body, operands, spec)
