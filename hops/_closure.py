"""Tensors a region body reads from its closure, made explicit inputs while tracing.

A body traced into a subgraph (``reenter_make_fx``) turns every tensor it reads from its
closure into a constant of the subgraph: a parameter or an outer traced value would then
get no gradient, and a fake one cannot even be kept (AOTAutograd refuses fake constants).
Dynamo lifts such tensors itself; for the other tracers a wrapper runs the body once on
the same (fake) values, records the tensors it reads that are neither inputs nor results
of its own calls, and passes them as extra inputs that a ``TorchFunctionMode`` substitutes
for the closure's tensors while the body runs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode

from hops._subgraph import body_name, named


class _ReadsOutsideInputs(TorchFunctionMode):
    """Records tensors that torch calls read but that are neither inputs nor results."""

    def __init__(self, inputs: Sequence[Any]) -> None:
        super().__init__()
        self.known = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
        self.outside: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor) and id(value) not in self.known:
                self.outside.setdefault(id(value), value)
        result = func(*args, **kwargs)
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                self.known.add(id(value))
        return result


class _SubstituteTensors(TorchFunctionMode):
    """Replaces the closure's tensors by the inputs that stand for them."""

    def __init__(self, replacements: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.replacements = replacements

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: self.replacements.get(id(t), t), (args, kwargs or {})
        )
        return func(*args, **kwargs)


def closed_over_tensors(body: Callable, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors ``body(*inputs)`` reads from outside its inputs (one extra run, recorded
    by no tracer)."""
    reads = _ReadsOutsideInputs(inputs)
    with disable_proxy_modes_tracing(), torch.no_grad(), reads:
        body(*inputs)
    return list(reads.outside.values())


def lift_closure(body: Callable, num_inputs: int, closed: Sequence[torch.Tensor]) -> Callable:
    """``body`` taking ``closed`` as extra trailing inputs (named like ``body``)."""

    def lifted(*values: Any) -> Any:
        replacements = {id(t): value for t, value in zip(closed, values[num_inputs:])}
        with _SubstituteTensors(replacements):
            return body(*values[:num_inputs])

    return named(lifted, body_name(body))
