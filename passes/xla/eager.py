"""The XLA device rules: what this package's HOPs do when called on XLA tensors outside
any tracer (how torch_xla programs run).

``hops`` imports this module (through ``passes.xla``) when it first meets an XLA tensor
(the ``hops.device_targets`` entry point), so eager torch_xla programs get these rules
without importing ``passes``. Under SPMD they emit what ``lower_to_xla`` emits:

- an annotation shards its value, as after ``xs.mark_sharding``;
- a ``local_map`` region is a manual-sharding region around its body, traced on local
  shapes and lowered;
- a scan is one XLA ``While`` around its body, traced once and lowered, not a Python loop
  that lazy tracing would unroll into ``length`` copies of the body.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._C import DispatchKey

from hops.local_map import local_map_hop
from hops.lowering import (
    across_calls_key,
    body_name,
    clone_aliased_outputs,
    distinct_tensors,
    flat_body,
    is_view,
    plan_body_key,
    run_scan_steps,
    scan_length,
    scan_step_examples,
    split_scan_operands,
    traced_graph,
)
from hops.scan import scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import ShardingSpec
from passes._infra import graph_modules
from passes.xla import ops
from passes.xla.rules import check_mesh_fits_xla
from passes.xla.while_loop import xla_while


def _spmd() -> bool:
    from torch_xla import runtime

    return runtime.is_spmd()


def _lower(gm: fx.GraphModule) -> fx.GraphModule:
    from passes.xla import lower_to_xla

    return lower_to_xla(gm)


@sharding_annotation_hop.py_impl(DispatchKey.XLA)
def annotate_on_xla(x: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
    """The result carries the sharding, as after ``xs.mark_sharding`` (without SPMD there is
    no sharding to state: a copy)."""
    if not _spmd():
        return x.clone()
    if spec.layout.has_partial or spec.grad.layout.has_partial:
        raise ValueError(
            f"annotate_sharding: on XLA, {spec!r} has a Partial placement; an XLA sharding describes a "
            "whole value, so an annotation cannot be Partial"
        )
    check_mesh_fits_xla(spec.mesh, "annotate_sharding: on XLA")
    return ops.sharding_constraint_on_xla(x, repr(spec))


# Lowered step graphs of bodies called eagerly: by body object for a plan's forward and
# backward bodies (``plan_body``: reused by equal calls), or by the body's ``CodeKey`` (a
# user's body, new per call), then by the examples' metadata and the spec; any other body is
# traced on every call. Bounded; the loops built from a step are kept with it (``xla_while``
# caches per step object).
_STEPS_BY_BODY: "weakref.WeakKeyDictionary[Any, dict[tuple, fx.GraphModule]]" = weakref.WeakKeyDictionary()
_STEPS_BY_KEY: "collections.OrderedDict[tuple, fx.GraphModule]" = collections.OrderedDict()
STEPS_BY_KEY_SIZE = 64


def lowered_step(body: Callable, examples: list, spec: Any, make: Callable[[], fx.GraphModule]) -> fx.GraphModule:
    """``make()`` (the body's lowered step graph on ``examples``), or the one an earlier call
    of the same body, or of a body with the same ``CodeKey``, made on equal examples."""
    metadata = tuple(
        (tuple(e.shape), e.dtype, e.device, e.requires_grad) if isinstance(e, torch.Tensor) else ("value", e) for e in examples
    )
    code_key = across_calls_key(body)
    if code_key is not None:
        key = (code_key, metadata, spec)
        step = _STEPS_BY_KEY.get(key)
        if step is None:
            step = _STEPS_BY_KEY[key] = make()
            while len(_STEPS_BY_KEY) > STEPS_BY_KEY_SIZE:
                _STEPS_BY_KEY.popitem(last=False)
        _STEPS_BY_KEY.move_to_end(key)
        return step
    plan_key = plan_body_key(body)
    if plan_key is None:
        return make()  # a body that may read Python state, with no key for it: made every call
    steps = _STEPS_BY_BODY.setdefault(plan_key, {})
    step = steps.get((metadata, spec))
    if step is None:
        step = steps[(metadata, spec)] = make()
    return step


def view_free_graph(body: Callable, examples: list) -> fx.GraphModule:
    """``body`` traced on fake ``examples`` into a graph without view ops or aliased outputs.

    Device rules run below functionalization, where torch_xla computes views of its tensors
    wrongly: each view op becomes its ``*_copy`` op (as ``functionalize(remove=
    "mutations_and_views")`` would; the body is already functionalized). An output that is an
    input (``return c, y``) becomes a copy: a staged step must compute each loop output."""
    import copy

    from torch.fx.experimental.proxy_tensor import make_fx

    traced = traced_graph(body)
    if traced is not None:
        # A body this package built from a traced graph (a plan's step) is that graph: copied,
        # not traced again.
        graph = clone_aliased_outputs(copy.deepcopy(traced))
    else:
        graph = clone_aliased_outputs(make_fx(flat_body(body), tracing_mode="fake")(*distinct_tensors(examples)))
    for module in graph_modules(graph):
        changed = False
        for node in module.graph.nodes:
            if node.op == "call_function" and is_view(node) and isinstance(node.target, torch._ops.OpOverload):
                packet = getattr(torch.ops.aten, f"{node.target.overloadpacket.__name__}_copy", None)
                copy = getattr(packet, node.target._overloadname, None) if packet is not None else None
                if copy is not None:
                    node.target, changed = copy, True
        if changed:
            module.recompile()
    return graph


@local_map_hop.py_impl(DispatchKey.XLA)
def run_local_map_on_xla(body: Callable, *tensors_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """Under SPMD, a manual-sharding region (the body traced on local shapes and lowered);
    without SPMD, the eager simulation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors, spec = local_map_hop.split_args(tensors_and_spec)
    if not _spmd():
        return local_map_hop.run(body, tensors, spec)
    check_mesh_fits_xla(spec.mesh, f"local_map({body_name(body)})")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    examples = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in tensors]
    with mode:
        local_examples = local_map_hop.body_inputs(examples, spec)
    step = lowered_step(body, local_examples, spec, lambda: _lower(view_free_graph(body, local_examples)))
    local = [
        value if placements is None else ops.enter_manual(value, repr(ShardingSpec(spec.mesh, placements)))
        for value, placements in zip(tensors, spec.in_placements)
    ]
    outputs = step(*local)
    return tuple(
        ops.exit_manual(output, repr(ShardingSpec(spec.mesh, placements)))
        for output, placements in zip(outputs, spec.out_placements)
    )


@scan_hop.py_impl(DispatchKey.XLA)
def run_scan_on_xla(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """A scan called eagerly on XLA tensors, as one XLA ``While``.

    ``body`` is traced on fake tensors (the HOPs it calls stay nodes), lowered by
    ``lower_to_xla`` under SPMD, and run by ``xla_while``. Without SPMD there is no sharding
    to lower: the HOPs run their eager rules inside the loop, except a ``local_map`` region,
    whose eager SPMD simulation compares device results by value, which a staged step has
    not got: it is refused. The lowered step is kept for later calls of the same body (a
    plan's step) or of a body with the same ``CodeKey`` (``hops.scan``'s contract); any other
    body is traced on every call, and XLA's own cache skips recompiling an unchanged loop.
    """
    *inputs, spec = inputs_and_spec
    carry, xs, additional = split_scan_operands(inputs, spec)
    length = scan_length(xs, spec)
    if length == 0:  # nothing to loop over: the eager rule makes the empty ys
        return run_scan_steps(body, inputs, spec)
    examples = [*carry, *scan_step_examples(xs), *additional]
    spmd = _spmd()

    def make() -> fx.GraphModule:
        step = view_free_graph(body, examples)
        return _lower(step) if spmd else step

    step = lowered_step(body, examples, (spec, spmd), make)
    if not spmd and any(node.target is local_map_hop for module in graph_modules(step) for node in module.graph.nodes):
        raise RuntimeError(
            f"scan({body_name(body)}): a local_map region in a scan on XLA tensors runs as a manual-sharding "
            "region, which needs SPMD: call torch_xla.runtime.use_spmd() first"
        )
    return xla_while(step, carry, xs, additional, length=length, reverse=spec.reverse, unroll=spec.unroll or 1)
