"""``RegionHOP``: a body HOP whose body runs once on its operands (``named_scope``) or on
each device's shards of them (``local_map``), and ``RegionPlan``: its traced autograd.

A region HOP call's traced autograd is a forward region that also returns the residuals,
and a backward region from (the primals it reads, the residuals, the present cotangents)
to the gradients of the operands that need one. The HOP supplies the specs of the two
regions and how a residual leaves the forward region (``residuals_out``) and enters the
backward one (``residuals_in``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from hops._body_hop.autograd import AutogradPlan
from hops._body_hop.base import BodyHOP
from hops._body_hop.body_record import plan_body
from hops._body_hop.caches import cached_plan
from hops._body_hop.flat_body import flat_body
from hops._body_hop.joint import body_output_examples, is_differentiable, split_joint, trace_connected_joint
from hops._body_hop.subgraph import body_name, named

__all__ = ["RegionHOP", "RegionPlan"]


class RegionHOP(BodyHOP):
    """A body HOP whose traced autograd is a forward and a backward region (see the module
    docstring): it says, besides ``BodyHOP``'s methods, the specs of the two regions and how
    residuals cross their boundaries."""

    def autograd_plan(self, body: Callable, operands: Sequence[Any], spec: Any) -> AutogradPlan:
        return cached_plan(lambda: RegionPlan(self, body, operands, spec), body, operands, spec)

    def forward_spec(self, spec: Any, residuals: Sequence[Any]) -> Any:
        """The forward region's spec, given the residuals it also returns. Default: ``spec``."""
        return spec

    def backward_spec(self, spec: Any, split: Any, residuals: Sequence[Any], needs_grad: Sequence[bool], present: Sequence[int]) -> Any:
        """The backward region's spec: it takes (primals it reads, residuals, ``present``
        cotangents) and returns the gradients of the operands that ``needs_grad``."""
        raise NotImplementedError

    def residuals_out(self, forward: Callable, num_outputs: int) -> Callable:
        """The forward region's body from the split's ``forward`` (its first ``num_outputs``
        results are the region's). Default: as it is."""
        return forward

    def residuals_in(self, residuals: Sequence[Any]) -> list[Callable]:
        """How each residual enters the backward region's body. Default: as it is."""
        return [lambda value: value for _ in residuals]


class RegionPlan(AutogradPlan):
    """The traced autograd of one region HOP call (see the module docstring). ``hop``
    supplies the specs of the forward and backward regions, and how residuals cross a
    region's boundary."""

    def __init__(self, hop: RegionHOP, body: Callable, operands: Sequence[Any], spec: Any) -> None:
        self.hop, self.spec, self.name = hop, spec, body_name(body)
        self.needs_grad = [is_differentiable(o) and o.requires_grad for o in operands]
        with disable_proxy_modes_tracing():
            examples = hop.body_inputs(operands, spec)
        flat = flat_body(body)
        outputs = body_output_examples(flat, examples)
        self.treespec = flat.treespec
        self.num_outputs = len(outputs)
        self.differentiable = [i for i, o in enumerate(outputs) if is_differentiable(o)]
        # Shape, dtype and device of each output the body computes (for zero cotangents).
        self.local_outputs = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outputs]
        joint, self.needs_grad = trace_connected_joint(flat, examples, outputs, self.needs_grad)
        self.split = split_joint(joint, len(examples), len(outputs))
        (forward_output,) = self.split.forward.graph.find_nodes(op="output")
        self.residuals = [v.meta["val"] for v in forward_output.args[0][self.num_outputs :]]
        self.forward_body: Callable | None = None
        self.backward_bodies: dict[tuple[int, ...], Callable] = {}

    def forward(self, operands: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]]:
        split = self.split
        if self.forward_body is None:  # made once: a plan reused across calls hands the same body on
            self.forward_body = plan_body(named(self.hop.residuals_out(split.forward, self.num_outputs), self.name))
        results = self.hop(self.forward_body, *operands, self.hop.forward_spec(self.spec, self.residuals))
        outputs, residuals = results[: self.num_outputs], results[self.num_outputs :]
        return outputs, [*(operands[i] for i in split.primals_in_backward), *residuals]

    def backward(self, saved: Sequence[Any], cotangents: Sequence[Any]) -> Sequence[Any]:
        if not any(self.needs_grad):  # no output depends on an input that requires grad
            return [None] * len(self.needs_grad)
        present = [i for i in self.differentiable if cotangents[i] is not None]
        backward_body = self.backward_bodies.get(tuple(present))
        if backward_body is None:
            backward_body = self.backward_bodies[tuple(present)] = self._backward_body(present)
        backward_spec = self.hop.backward_spec(self.spec, self.split, self.residuals, self.needs_grad, present)
        grads = iter(self.hop(backward_body, *saved, *(cotangents[i] for i in present), backward_spec))
        return [next(grads) if need else None for need in self.needs_grad]

    def _backward_body(self, present: Sequence[int], residual_inputs: Sequence[Callable] | None = None) -> Callable:
        """The backward region's body: ``(primals it reads, residuals, present cotangents) ->
        gradients``; each residual enters through ``residual_inputs`` (default: as the HOP's
        ``residuals_in`` says)."""
        split = self.split
        num_primals = len(split.primals_in_backward)
        if residual_inputs is None:
            residual_inputs = self.hop.residuals_in(self.residuals)
        local_outputs, differentiable = self.local_outputs, self.differentiable

        def backward(*values: Any) -> tuple:
            primals = values[:num_primals]
            residuals = [unwrap(v) for unwrap, v in zip(residual_inputs, values[num_primals : num_primals + len(residual_inputs)])]
            given = list(values[num_primals + len(residual_inputs) :])
            like, given = given[0], iter(given)
            # An output nobody differentiated gets a zero cotangent here, inside the region:
            # no global zeros and no layout for them are needed outside. (Made like a present
            # cotangent, so a traced graph makes them on the device it runs on.)
            full = [
                next(given) if i in present else like.new_zeros(local_outputs[i][0], dtype=local_outputs[i][1])
                for i in differentiable
            ]
            return tuple(split.backward(*primals, *residuals, *full))

        return plan_body(named(backward, f"{self.name}_bwd"))
