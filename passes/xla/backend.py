"""``torch.compile(model, backend="hops_xla")``: Dynamo (HOPs kept) -> AOTAutograd (forward
and backward graphs with the HOPs) -> ``check_placements`` -> ``lower_to_xla`` -> the lowered
graphs run on the caller's XLA tensors (no copies: XLA tensors in, XLA tensors out).

Each lowered graph is staged once per input shapes and dtypes into one XLA computation
(``staging.py``) that every call binds to its tensors: one node of torch_xla's lazy graph per
call instead of re-tracing each op on the host, and torch_xla compiles each distinct
program once (its cache is keyed by the graph's hash). This is not torch_xla's Dynamo
bridge (``extract_compiled_graph``, what ``backend="openxla"`` uses): under SPMD, torch_xla
2.9's bridge returns wrong values once an input's sharding changes between calls (measured
here: a plain two-layer model trained with ``backend="openxla"`` under SPMD departs from
eager at the third SGD step; without SPMD it does not). A staged computation is specific to
shapes and dtypes only; shardings stay with the tensors bound to it.

Not reachable from here (torch_xla 2.9's own behaviour, measured with ``backend="eager"`` too):
Dynamo cannot trace ``layer_norm`` on XLA tensors with a symbolic size (``dynamic=True``, or
``torch._dynamo.mark_dynamic``): torch_xla's kernel calls ``numel()`` under fake tensors and Dynamo
stops before any backend runs. Models with LayerNorm (GPT-2, OPT) compile with static shapes
(a graph per batch size); RMSNorm models (Llama, Qwen3, Mistral) compile with ``dynamic=True``.

A backward on XLA tensors needs the autograd engine to have counted the XLA device: under SPMD,
no CPU backward may run before the first XLA backward (``prepare_autograd_for_xla``, called first
thing, makes the order free; ``XlaAutogradOrderError`` says so when it is too late).

The backend is found by name through the ``torch_dynamo_backends`` entry point group:
``import passes`` is not needed to use it. ``lowered_and_staged`` is also how
``hops.assume_pure`` runs its graphs on XLA tensors (registered by ``passes.xla``). The
target-neutral backend ``hops_inductor`` is in ``passes/backends.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["XlaAutogradOrderError", "hops_xla", "lowered_and_staged", "prepare_autograd_for_xla"]


class StagedGraph:
    """A lowered graph called as one staged XLA computation when every input is an XLA
    tensor (else it runs as it is). Outputs the graph states as ``None`` (a backward graph's
    gradients of inputs that need none) stay ``None``; the rest come from the computation."""

    def __init__(self, gm: fx.GraphModule) -> None:
        from passes.xla.staging import StagedFunction

        self.gm = gm
        outputs = gm.graph.output_node().args[0]
        self.none_outputs = tuple(i for i, value in enumerate(outputs) if value is None)
        self.count = len(outputs)
        self.metadata = _static_xla_metadata(gm)
        self.checked = False

        def tensor_outputs(*inputs: Any) -> list:
            return [value for i, value in enumerate(gm(*inputs)) if i not in self.none_outputs]

        self.staged = StagedFunction(tensor_outputs, name="graph")

    def __call__(self, *inputs: Any) -> list:
        if self.metadata is not None and not self.checked:
            # Once: what arrives may differ from the trace, where torch_xla's kernel and torch's
            # meta rule disagree (LayerNorm's saved mean of a bf16 input: float32 traced, bf16 on
            # XLA). Staged for the trace, the call would be refused; then stage for what arrives.
            from passes.xla.staging import metadata

            self.checked = True
            if metadata(inputs) != self.metadata:
                self.metadata = None
        if self.metadata is not None:  # the graph's inputs are known: no per-input checks
            values = self.staged(*inputs, key=self.metadata)
        elif inputs and all(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in inputs):
            values = self.staged(*inputs)
        else:
            return list(self.gm(*inputs))
        for i in self.none_outputs:
            values.insert(i, None)
        return values


def _static_xla_metadata(gm: fx.GraphModule) -> Any:
    """The shapes and dtypes of ``gm``'s inputs when every one is an XLA tensor of a
    static shape (as traced: the graph runs on nothing else), else None."""
    from passes.xla.staging import metadata

    values = [node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder")]
    if not values or not all(
        isinstance(v, torch.Tensor) and v.device.type == "xla" and all(isinstance(d, int) for d in v.shape)
        for v in values
    ):
        return None
    return metadata(values)


_QUEUES_READY = False


class XlaAutogradOrderError(RuntimeError):
    """No backward on XLA tensors can run in this process: torch's autograd engine sized its
    per-device queues at a backward that ran before the XLA device counted (torch_xla's own
    behaviour: under SPMD, any backward before the first XLA backward)."""


def prepare_autograd_for_xla() -> None:
    """Run one XLA backward, once per process, before tracing a joint graph on XLA tensors:
    torch's autograd engine sizes its per-device queues at the first backward it runs, and a
    backward traced (under fake tensors) before any real XLA backward fails its internal
    assert ``device.index() < device_ready_queues_.size()``. Where a backward ran before it
    (a CPU reference computed first), that assert fails here: ``XlaAutogradOrderError`` says
    what to do instead of torch's internal assert."""
    global _QUEUES_READY
    if not _QUEUES_READY:
        import torch_xla

        probe = torch.ones(1, device=torch_xla.device(), requires_grad=True)
        try:
            (probe * 2).sum().backward()
        except RuntimeError as error:
            if "device_ready_queues_" not in str(error):
                raise
            raise XlaAutogradOrderError(
                "backward on XLA tensors cannot run in this process: a backward (e.g. on CPU tensors) ran "
                "before the first backward on XLA tensors, and torch's autograd engine sized its device queues "
                "then, without the XLA device (torch_xla's own behaviour; under SPMD even once the device "
                "exists). Run one XLA backward first, at the start of the program (right after "
                "torch_xla.runtime.use_spmd()): call passes.xla.prepare_autograd_for_xla(), or compute CPU "
                "references in another process; torch.no_grad() inference and graphs whose gradients are "
                "traced in (make_fx of torch.autograd.grad, then passes.lower_to_xla) need no backward"
            ) from error
        _QUEUES_READY = True


def lowered_and_staged(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """An AOTAutograd graph lowered to XLA (its placements checked first) and staged: the
    compiler of ``backend="hops_xla"`` and of ``hops.assume_pure`` on XLA tensors."""
    from functorch.compile import make_boxed_func

    from passes.check import check_placements
    from passes.xla import lower_to_xla
    from passes.xla.portable import refuse_host_only_ops

    lowered = lower_to_xla(check_placements(gm))
    refuse_host_only_ops(lowered, "hops_xla: the staged graph")
    return make_boxed_func(StagedGraph(lowered))


def hops_xla(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The Dynamo backend ``"hops_xla"`` (see the module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    if any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in example_inputs):
        prepare_autograd_for_xla()
    return aot_autograd(fw_compiler=lowered_and_staged)(gm, example_inputs)
