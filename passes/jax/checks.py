"""Index checks: torch raises on an index out of range (``embedding``, ``gather``, ``x[i]``, ...),
where a jax program clamps it (a gather) or drops it (a scatter) and goes on, its result silently
wrong. The rules of the ops torch checks (``passes/jax/aten.py``) state their ranges with
``in_range``; a function run under ``checked`` turns those statements into ``checkify`` checks,
which ``raising`` raises after the call as ``IndexOutOfRange`` (the ``hops_jax`` backend runs every
graph so). Elsewhere (``lower_to_jax``'s function as a user jits it) ``in_range`` states nothing:
the function is jax's own, with jax's indexing.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

__all__ = ["IndexOutOfRange", "in_range", "checked", "raising"]


class IndexOutOfRange(IndexError, RuntimeError):
    """An index out of its range in a compiled program (torch raises ``IndexError`` for some of
    these ops, ``RuntimeError`` for others: this is both)."""


_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar("hops_jax_index_checks", default=False)


def in_range(index: Any, low: int, high: int, what: str) -> None:
    """State that every element of ``index`` (an integer jax array) is in ``[low, high)``; ``what``
    names the op and dim in the error. A no-op outside ``checked``."""
    if not _CHECKING.get() or getattr(index, "size", 1) == 0:
        return
    import jax.numpy as jnp
    from jax.experimental import checkify

    outside = (index < low) | (index >= high)
    first = jnp.ravel(index)[jnp.argmax(jnp.ravel(outside))]
    checkify.check(~jnp.any(outside), f"{what}: index {{index}} is out of bounds (expected {low} <= index < {high})", index=first)


@contextlib.contextmanager
def _checking():
    token = _CHECKING.set(True)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def checked(function: Callable[..., Any], static: tuple[int, ...] = ()) -> Callable[..., Any]:
    """``function`` returning ``(checkify error, its result)``, the ``in_range`` statements of the
    rules it runs checked. ``static``: positions of arguments ``jax.jit`` takes as static (sizes),
    passed through as they are."""
    from jax.experimental import checkify

    def run(*args: Any) -> Any:
        fixed = {i: args[i] for i in static}

        def traced(*rest: Any) -> Any:
            given = iter(rest)
            with _checking():
                return function(*(fixed[i] if i in fixed else next(given) for i in range(len(args))))

        return checkify.checkify(traced, errors=checkify.user_checks)(*(a for i, a in enumerate(args) if i not in fixed))

    return run


def raising(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a jitted ``checked`` function) returning its result alone, raising
    ``IndexOutOfRange`` where a check failed (waiting for the program to tell)."""

    def call(*args: Any) -> Any:
        error, result = function(*args)
        message = error.get()
        if message is not None:
            raise IndexOutOfRange(f"hops_jax: {message.split(' (`check` failed)')[0]}")
        return result

    return call
