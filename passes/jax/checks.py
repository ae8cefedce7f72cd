"""Checks torch makes at run time that a jax program does not: an index out of range
(``embedding``, ``gather``, ``x[i]``, a scatter, ...), which a jax program clamps (a gather) or
drops (a scatter); an integer divided by zero, which gives jax an arbitrary value; a condition
asserted on tensors (``torch._assert_async``: what Dynamo makes of a Python ``assert``), which a jax
program has no host check for; a linalg op's status (a singular matrix to invert, one not positive-
definite to factor), which jax answers with inf / NaN. Either way the program goes on, where torch
raises. The rules of the ops torch checks (``passes/jax/aten.py``) state what must hold with
``in_range`` / ``nonzero`` / ``holds`` / ``factored``; a function run under ``checked`` turns those
statements into ``checkify`` checks, which ``raising`` raises after the call, as torch's error (the
``hops_jax`` backend runs every graph so). Elsewhere (``lower_to_jax``'s function as a user jits
it) they state nothing: the function is jax's own, with jax's semantics.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import torch

__all__ = ["IndexOutOfRange", "IntegerDivisionByZero", "AssertionFailed", "in_range", "nonzero", "holds", "factored", "checked", "raising"]


class IndexOutOfRange(IndexError, RuntimeError):
    """An index out of its range in a compiled program (torch raises ``IndexError`` for some of
    these ops, ``RuntimeError`` for others: this is both)."""


class IntegerDivisionByZero(ZeroDivisionError, RuntimeError):
    """An integer divided by zero in a compiled program (torch raises a ``RuntimeError`` saying
    ``ZeroDivisionError``: this is both)."""


class AssertionFailed(AssertionError, RuntimeError):
    """A condition asserted on tensors in a compiled program was false (torch raises a
    ``RuntimeError`` with the assertion's message; eager Python, an ``AssertionError``: this is both)."""


# (each check's message starts with its kind's name; torch's LinAlgError is named _LinAlgError)
_KINDS = {kind.__name__: kind for kind in (IndexOutOfRange, IntegerDivisionByZero, AssertionFailed)} | {"LinAlgError": torch.linalg.LinAlgError}
_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar("hops_jax_checks", default=False)


def in_range(index: Any, low: int, high: int, what: str) -> None:
    """State that every element of ``index`` (an integer jax array) is in ``[low, high)``; ``what``
    names the op and dim in the error. A no-op outside ``checked``."""
    if not _CHECKING.get() or getattr(index, "size", 1) == 0:
        return
    _check("IndexOutOfRange", (index < low) | (index >= high), f"{what}: index {{first}} is out of bounds (expected {low} <= index < {high})", index)


def nonzero(x: Any, divisor: Any, what: str) -> None:
    """State that ``divisor`` holds no zero where ``x`` / ``divisor`` divides integers (torch raises
    there; floats divide to inf or NaN in both). A no-op outside ``checked``."""
    import jax.numpy as jnp

    if not _CHECKING.get() or not jnp.issubdtype(jnp.result_type(x, divisor), jnp.integer) or getattr(divisor, "size", 1) == 0:
        return
    _check("IntegerDivisionByZero", jnp.asarray(divisor) == 0, f"{what}: ZeroDivisionError (an integer divided by zero)")


def holds(condition: Any, message: str) -> None:
    """State that every element of ``condition`` is true (nonzero); ``message`` is the error's. A
    no-op outside ``checked``."""
    import jax.numpy as jnp

    if not _CHECKING.get():
        return
    # (the message is formatted: a brace of the user's is a brace)
    _check("AssertionFailed", jnp.asarray(condition) == 0, message.replace("{", "{{").replace("}", "}}"))


def factored(info: Any, api_name: str) -> None:
    """State that a linalg op's ``info`` (torch's status: 0, or the failing diagonal element / minor,
    1-based) is zero everywhere; else ``torch.linalg.LinAlgError``, as torch raises. A no-op
    outside ``checked``."""
    if not _CHECKING.get() or getattr(info, "size", 1) == 0:
        return
    problem = "is not positive-definite" if "cholesky" in api_name else "is singular"
    _check("LinAlgError", info != 0, f"{api_name}: the input {problem} (info {{first}}: the failing diagonal element or leading minor)", info)


def _check(kind: str, failed: Any, template: str, among: Any = None) -> None:
    """A checkify check that no element of ``failed`` is true, whose failure ``raising`` raises as
    ``_KINDS[kind]``: the message is ``kind: template``, ``{first}`` in it the first element of
    ``among`` where ``failed`` is."""
    import jax.numpy as jnp
    from jax.experimental import checkify

    values = {} if among is None else {"first": jnp.ravel(among)[jnp.argmax(jnp.ravel(failed))]}
    checkify.check(~jnp.any(failed), f"{kind}: {template}", **values)


@contextlib.contextmanager
def _checking():
    token = _CHECKING.set(True)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def checked(function: Callable[..., Any], static: tuple[int, ...] = ()) -> Callable[..., Any]:
    """``function`` returning ``(checkify error, its result)``, the statements of the rules it runs
    checked. ``static``: positions of arguments ``jax.jit`` takes as static (sizes), passed through
    as they are."""
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
    """``function`` (a jitted ``checked`` function) returning its result alone, raising the
    error of a check that failed (waiting for the program to tell)."""

    def call(*args: Any) -> Any:
        error, result = function(*args)
        message = error.get()
        if message is not None:
            message = message.split(" (`check` failed)")[0]
            # (checkify may put where in a mapped region first: "at mapped index 2: ...")
            kind = next((name for name in _KINDS if f"{name}: " in message), None)
            if kind is None:  # (a check of jax's own)
                raise RuntimeError(f"hops_jax: {message}")
            raise _KINDS[kind](f"hops_jax: {message.replace(f'{kind}: ', '', 1)}")
        return result

    return call
