"""``code_key(fn)``: a hashable key equal for two calls of functions that would trace the same.

A body HOP called eagerly on XLA tensors traces its body on every call, and a new function
object per call (``def step`` inside a training step, a lambda) is the common case. Two
functions trace the same when they run the same code on equal Python state: the key holds
the code object, and the value of everything the code can read besides its arguments: its
closure cells, its defaults, its attributes, and the globals its code names (functions it calls are keyed
the same way, recursively). Values are keyed by value (numbers, strings, specs and other
frozen values, containers of them), tensors by identity and metadata (a traced body gets
closed-over tensors as inputs, so their values do not matter), and library code (torch, this
package, the standard library) by identity.

Anything else a function could read (an object's attributes, a module's mutable state, a
bound method's instance) has no key: ``code_key`` returns ``None`` and the caller traces on
every call. Python side effects and Python random numbers in a cached body happen once, when
it is traced (as under ``jax.jit``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from typing import Any, Callable

import torch

__all__ = ["code_key", "CodeKey"]

# Code of these packages is treated as constant: keyed by identity, not walked.
_LIBRARIES = ("torch", "hops", "passes", "functorch", "torch_xla", "numpy", "math", "operator", "functools", "builtins", "typing", "collections", "itertools", "enum", "dataclasses", "jax")
_MAX_DEPTH = 16  # nesting of functions and containers walked (a region built in a closure: ~10)

_PLAIN = (type(None), bool, int, str, bytes, type(Ellipsis), torch.dtype, torch.device, torch.layout, torch.memory_format)


class CodeKey(tuple):
    """A key from ``code_key``: valid across calls (not only within one trace).

    ``tensors`` holds the ids of the tensors the key was built from: a body reading a tensor
    the key does not hold (reached through an unkeyed path) must not reuse a trace."""

    tensors: frozenset[int] = frozenset()


class _Unkeyable(Exception):
    pass


def _is_library(module_name: str | None) -> bool:
    if not module_name:
        return False
    top = module_name.split(".", 1)[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names ``code`` and the code nested in it may load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


class _Walker:
    def __init__(self, tensor_key: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.tensors: set[int] = set()
        self.tensor_key = tensor_key
        self.active: set[int] = set()  # functions being keyed (recursion)

    def value(self, v: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Unkeyable
        kind = type(v)
        if kind in _PLAIN or isinstance(v, enum.Enum):
            return (kind, v)
        if kind in (float, complex):
            return (kind, repr(v))  # -0.0 and 0.0 trace differently; nan equals nan here
        if isinstance(v, torch.Tensor):
            self.tensors.add(id(v))
            identity = id(v) if self.tensor_key is None else self.tensor_key(v)
            return ("tensor", identity, tuple(v.shape), v.dtype, v.device, v.requires_grad, v.layout)
        if kind in (tuple, list) or isinstance(v, tuple):
            return (kind, tuple(self.value(item, depth + 1) for item in v))
        if kind is dict:
            return (dict, tuple((self.value(k, depth + 1), self.value(item, depth + 1)) for k, item in v.items()))
        if kind in (set, frozenset):
            return (kind, frozenset(self.value(item, depth + 1) for item in v))
        if kind is torch.Size:
            return (kind, tuple(v))
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and v.__dataclass_params__.frozen:
            hash(v)  # a frozen value (a spec): keyed by value
            return (kind, v)
        if isinstance(v, types.ModuleType):
            return ("module", v)
        if isinstance(v, type):
            return ("type", v)
        if isinstance(v, types.FunctionType):
            return self.function(v, depth + 1)
        if isinstance(v, functools.partial):
            return (functools.partial, self.value(v.func, depth + 1), self.value(v.args, depth + 1), self.value(v.keywords, depth + 1))
        if isinstance(v, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
            return ("builtin", v)
        if callable(v) and _is_library(getattr(type(v), "__module__", None)) and not isinstance(v, torch.nn.Module):
            # A library callable object (a torch function wrapper, a ufunc): constant code.
            try:
                hash(v)
            except TypeError:
                raise _Unkeyable from None
            return ("library", v)
        raise _Unkeyable

    def function(self, fn: types.FunctionType, depth: int) -> Any:
        if _is_library(getattr(fn, "__module__", None)):
            return ("library", fn)
        if id(fn) in self.active:
            return ("recursive", id(fn))
        self.active.add(id(fn))
        try:
            code = fn.__code__
            cells = []
            for cell in fn.__closure__ or ():
                try:
                    cells.append(self.value(cell.cell_contents, depth + 1))
                except ValueError:  # an empty cell
                    cells.append(("empty",))
            fn_globals = fn.__globals__
            names = sorted(_names(code))
            read = []
            for name in names:
                if name in fn_globals:
                    value = fn_globals[name]
                    read.append((name, self.value(value, depth + 1)))
                    if isinstance(value, types.ModuleType) and not _is_library(value.__name__):
                        # A user module's attributes the code may read (``config.scale``).
                        read.extend(
                            (f"{name}.{attribute}", self.value(getattr(value, attribute), depth + 1))
                            for attribute in names
                            if hasattr(value, attribute)
                        )
            return (
                code,
                tuple(cells),
                self.value(fn.__defaults__, depth + 1),
                self.value(fn.__kwdefaults__, depth + 1),
                self.value(fn.__dict__, depth + 1),  # attributes its code may read (``helper.scale``)
                tuple(read),
            )
        finally:
            self.active.discard(id(fn))


def code_key(fn: Callable, *structure: Any, tensor_key: Callable[[torch.Tensor], Any] | None = None) -> CodeKey | None:
    """A key for ``fn`` (see the module docstring) with the hashable ``structure`` of the call,
    and the torch state a trace depends on; ``None`` where ``fn`` reads state with no key.
    ``tensor_key(t)`` keys a tensor in place of its identity (with its metadata)."""
    walker = _Walker(tensor_key)
    try:
        # Tensor metadata is read with torch function modes off: under an enclosing body's
        # inspection, reading a closed-over tensor's shape would count as the body reading it.
        with torch._C.DisableTorchFunction():
            if isinstance(fn, types.FunctionType):
                key = walker.function(fn, 0)
            elif isinstance(fn, functools.partial):
                key = walker.value(fn, 0)
            else:
                return None
        hash(structure)
    except (_Unkeyable, TypeError, RecursionError):
        return None
    autocast = tuple(
        (device, torch.get_autocast_dtype(device)) for device in ("cuda", "cpu", "xla") if torch.is_autocast_enabled(device)
    )
    state = (torch.get_default_dtype(), torch.is_grad_enabled(), autocast)
    result = CodeKey((key, structure, state))
    result.tensors = frozenset(walker.tensors)
    return result
