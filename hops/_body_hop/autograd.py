"""How a traced body HOP call differentiates: an ``AutogradPlan`` builds the forward and
backward HOP nodes, and ``HopFunction`` is the autograd node that runs them, so forward and
backward graphs carry the HOP.

Outside tracing, on the devices where the eager semantics runs, a body HOP instead runs its
reference semantics above autograd (``needs_traced_autograd`` tells the two apart)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hops._body_hop.joint import is_tracing

__all__ = ["AutogradPlan", "HopFunction", "NotDifferentiablePlan", "needs_traced_autograd", "lacks_a_derivative"]


def needs_traced_autograd(values: Sequence[Any]) -> bool:
    """Whether a HOP differentiates through its traced joint (``HopFunction``) rather than by
    running its eager semantics under autograd: while a tracer records, and on XLA, where the
    forward and backward run as lowered HOP nodes."""
    return is_tracing(values) or any(isinstance(v, torch.Tensor) and v.device.type == "xla" for v in values)


class AutogradPlan:
    """How one traced call of a body HOP differentiates: ``forward`` runs the forward node(s)
    below autograd and returns ``(outputs, saved)``; ``backward`` runs the backward node(s)
    on what was saved and the outputs' cotangents (``None`` where an output got none) and
    returns one gradient (or ``None``) per operand. ``backward`` runs where autograd is live
    when double backward asks for it, so its HOP calls are differentiated in turn."""

    def forward(self, operands: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]]:
        raise NotImplementedError

    def backward(self, saved: Sequence[Any], cotangents: Sequence[Any]) -> Sequence[Any]:
        raise NotImplementedError

    # The structure of the body's result (the HOP's results are returned in it).
    treespec: Any = None


def lacks_a_derivative(error: BaseException) -> bool:
    """Whether ``error`` is autograd's for differentiating an op that has no derivative formula
    (``derivative for aten::... is not implemented``): a CPU kernel's backward, differentiated
    again, is one."""
    return isinstance(error, RuntimeError) and "derivative for" in str(error) and "is not implemented" in str(error)


class NotDifferentiablePlan(AutogradPlan):
    """The plan of a call whose body holds an op without a derivative (``lacks_a_derivative``):
    the call runs as one HOP node, and only differentiating its results raises the error, as
    torch does for such an op itself. (A backward region differentiated again, under
    ``create_graph=True``, is one: its second derivative is never asked for by a gradient
    that is only read.)"""

    def __init__(self, hop: Any, body: Callable, spec: Any, error: RuntimeError) -> None:
        self.hop, self.body, self.spec, self.error = hop, body, spec, error

    def forward(self, operands: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]]:
        return self.hop(self.body, *operands, self.spec), []

    def backward(self, saved: Sequence[Any], cotangents: Sequence[Any]) -> Sequence[Any]:
        raise RuntimeError(str(self.error)) from self.error


class HopFunction(torch.autograd.Function):
    """The autograd node of a traced body HOP call: the forward and backward are HOP nodes
    built by an ``AutogradPlan``, so forward and backward graphs carry the HOP."""

    @staticmethod
    def forward(ctx: Any, plan: AutogradPlan, *operands: Any):
        with torch._C._AutoDispatchBelowAutograd():
            outputs, saved = plan.forward(operands)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        # Ints and symbolic ints cannot go through save_for_backward: keep them aside. The
        # operands are kept too (they are this node's inputs: no copy), for a double backward.
        values = [*operands, *saved]
        ctx.num_operands = len(operands)
        ctx.non_tensors = [None if isinstance(v, torch.Tensor) else v for v in values]
        ctx.save_for_backward(*(v for v in values if isinstance(v, torch.Tensor)))
        not_differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and not (o.is_floating_point() or o.is_complex())]
        if not_differentiable:
            ctx.mark_non_differentiable(*not_differentiable)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Any):
        tensors = iter(ctx.saved_tensors)
        values = [next(tensors) if v is None else v for v in ctx.non_tensors]
        operands, saved = values[: ctx.num_operands], values[ctx.num_operands :]
        if all(c is None for c in cotangents):
            return (None,) * len(ctx.needs_input_grad)
        if torch.is_grad_enabled() and any(isinstance(o, torch.Tensor) and o.requires_grad for o in operands):
            # Double backward: the gradients must be differentiable in the operands, also
            # through the residuals, which the forward computed below autograd (constants
            # here). They are computed again from the operands, where autograd is live.
            _, saved = ctx.plan.forward(operands)
        grads = ctx.plan.backward(saved, list(cotangents))
        return (None, *(g if need else None for g, need in zip(grads, ctx.needs_input_grad[1:])))
