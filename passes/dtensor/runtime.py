"""What a graph lowered to DTensor calls at run time (``passes/dtensor/rules.py`` emits these).

Each function is a ``leaf_call`` (one node under symbolic tracing, so a pickled lowered
graph comes back the same) and takes the node's typed spec as its last argument:

- ``annotate_on_dtensors(x, spec)``: ``x`` redistributed to ``spec.placements``; under autograd
  its gradient is redistributed to ``spec.grad.placements``;
- ``enter_region(x, spec, index)`` / ``exit_region(local, spec, index)``: a ``local_map``
  region's boundary: a global DTensor -> this rank's local tensor per ``in_placements``
  (gradient back per the region's gradient layout, ``Partial`` where the local gradients are
  partial sums), a local tensor -> a DTensor per ``out_placements`` (its cotangent taken per
  the region's convention, ``LocalMapSpec.cotangent_placement``);
- ``run_scan_on_dtensors(body, *inputs, spec)``: the scan as a Python loop over steps;
- ``run_in_profiler_scope(body, *inputs, spec)``: a named scope's body under
  ``torch.profiler.record_function(spec.name)``;
- ``replicated(value, mesh)``: a graph's tensor constant or a factory op's result (a plain
  tensor every rank computes whole) as a replicated DTensor;
- ``run_replicated(op, *args, **kwargs)``: an ATen op DTensor has no sharding strategy for (the
  solver prices it so): its DTensor inputs gathered to ``Replicate`` (``redistribute``, which
  autograd differentiates) and laid out as their DTensors state (as traced), the op run on
  their local tensors, its tensor outputs replicated DTensors again;
- ``check_on_dtensors(op, *args, **kwargs)``: a check returning nothing that DTensor cannot
  run (``torch.export``'s ``_assert_tensor_metadata``, ``_assert_async``): run on what it
  reads of each DTensor argument, the global metadata or the gathered value;
- ``run_by_inplace_rule(inplace, x, *args, **kwargs)``: a functional op DTensor places by its
  in-place variant's rule but does not run (torch 2.9: ``fill.Scalar``), run as that variant
  on a copy of ``x``;
- ``run_with_replicated_parameters(op, *args, **kwargs)``: a norm's backward whose weight and
  bias DTensor takes as they arrive (torch 2.9), run with them replicated.

DTensor's public ``redistribute`` refuses a ``Partial`` target; ``redistribute_to`` reaches it
through ``Replicate`` and this package's reference split (``hops._layout``): the first rank
along the axis keeps the value of a pending sum, the others hold zeros (no collective).
A plain tensor where a DTensor is expected (made by a factory op, the same on every rank) is
taken as replicated.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from hops.lowering import DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF, DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT, run_scan_steps
from hops.named_scope import ScopeSpec
from hops.scan import ScanSpec
from hops.specs import LocalMapSpec, Mesh, Placement, ShardingSpec
from passes._infra import leaf_call, runner_spec

__all__ = [
    "annotate_on_dtensors",
    "enter_region",
    "exit_region",
    "run_scan_on_dtensors",
    "run_in_profiler_scope",
    "run_replicated",
    "check_on_dtensors",
    "run_by_inplace_rule",
    "replicated",
    "redistribute_to",
    "register_device_mesh",
    "device_mesh_for",
]

# hops.Mesh (a value) -> the DeviceMesh a lowering was given for it: what a region's outputs
# are laid out on (a lowered graph holds only typed values, never a live process group).
_DEVICE_MESHES: dict[Mesh, Any] = {}


def register_device_mesh(mesh: Mesh, device_mesh: Any) -> None:
    """Run graphs lowered for ``mesh`` on ``device_mesh`` (``lower_to_dtensor`` does this)."""
    _DEVICE_MESHES[mesh] = device_mesh
    declare_size_arguments()


def declare_size_arguments() -> None:
    """Where DTensor keys its cache of an op's output layout and global shape by the op's
    tensor arguments only (``DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF``: torch 2.9's
    ``embedding_dense_backward``), declare the op's other arguments part of the key, as later
    torch does: else a second call differing only in a size (the gradient of an embedding of
    another vocabulary, GPT-2's and OPT's positions) gets the first's global shape. Whether the op is in
    the lowered graph or comes from autograd of it at run time."""
    if not DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    declared = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
    for name in DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF:
        packet, overload = name.removeprefix("aten.").rsplit(".", 1)
        op = getattr(getattr(torch.ops.aten, packet), overload)
        if op not in declared:
            first = next(i for i, a in enumerate(op._schema.arguments) if "Tensor" not in str(a.type))
            declared[op] = RuntimeSchemaInfo(static_argnum=first)


def device_mesh_for(mesh: Mesh, what: str) -> Any:
    device_mesh = _DEVICE_MESHES.get(mesh)
    if device_mesh is None:
        raise RuntimeError(
            f"{what}: no DeviceMesh for {mesh!r} in this process; run passes.lower_to_dtensor(gm, device_mesh) "
            "here (it registers the mesh) before running the lowered graph"
        )
    return device_mesh


def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def as_dtensor(value: torch.Tensor, device_mesh: Any) -> Any:
    """``value`` as a DTensor: a plain tensor (every rank computed it whole) is replicated."""
    DTensor = _dtensor_class()
    if isinstance(value, DTensor):
        return value
    from torch.distributed.tensor import Replicate

    return DTensor.from_local(value, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)


def redistribute_to(x: Any, placements: Sequence[Placement]) -> Any:
    """DTensor ``x`` laid out per ``placements`` (this package's), by DTensor's collectives;
    a ``Partial`` target is reached from ``Replicate`` locally (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    target = tuple(p.to_dtensor() for p in placements)
    current = tuple(x.placements)
    if current == target:
        return x
    to_partial = [axis for axis, (now, want) in enumerate(zip(current, target)) if want.is_partial() and now != want]
    middle = tuple(Replicate() if axis in to_partial else want for axis, want in enumerate(target))
    if middle != current:
        x = x.redistribute(x.device_mesh, middle)
    if not to_partial:
        return x
    local = x.to_local()
    coordinate = x.device_mesh.get_coordinate()
    for axis in to_partial:
        if target[axis].reduce_op == "sum" and coordinate[axis] != 0:
            local = torch.zeros_like(local)  # avg / max / min of equal values: each rank keeps the value
    return DTensor.from_local(local, x.device_mesh, target, run_check=False, shape=x.shape, stride=x.stride())


class _Annotate(torch.autograd.Function):
    """Redistribute forward to the value's layout, backward to the gradient's."""

    @staticmethod
    def forward(ctx: Any, x: Any, spec: ShardingSpec) -> Any:
        ctx.spec = spec
        out = redistribute_to(as_dtensor(x, device_mesh_for(spec.mesh, "annotate_on_dtensors")), spec.placements)
        if not out.is_contiguous():
            # The graph may view the value (as traced, with the strides fake tensors gave it);
            # DTensor's global strides after ops and redistributions can differ from those, so
            # the annotation's value is made contiguous, which every such view accepts.
            out = out.contiguous()
        # A new tensor even where the layout is kept: autograd's output of a Function.
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        spec = ctx.spec
        return redistribute_to(as_dtensor(grad, device_mesh_for(spec.mesh, "annotate_on_dtensors")), spec.grad.placements), None


@leaf_call
def annotate_on_dtensors(x: Any, spec: ShardingSpec) -> Any:
    """A sharding annotation on DTensors: ``x`` redistributed to ``spec.placements``, its
    gradient (under autograd) to ``spec.grad.placements``."""
    runner_spec("annotate_on_dtensors", spec, ShardingSpec)
    return _Annotate.apply(x, spec)


class _EnterRegion(torch.autograd.Function):
    """A region input: global DTensor -> local tensor; local gradient -> DTensor laid out per
    the region's gradient placements for the input."""

    @staticmethod
    def forward(ctx: Any, x: Any, spec: LocalMapSpec, index: int) -> torch.Tensor:
        ctx.spec, ctx.index = spec, index
        device_mesh = device_mesh_for(spec.mesh, "enter_region")
        ctx.device_mesh = device_mesh
        local = redistribute_to(as_dtensor(x, device_mesh), spec.in_placements[index]).to_local()
        # The body was traced on contiguous stand-ins (``hops.lowering.at_boundary``).
        return local.contiguous() if not local.is_contiguous() else local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        from torch.distributed.tensor import DTensor

        placements = [p.to_dtensor() for p in ctx.spec.grad_placement(ctx.index)]
        return DTensor.from_local(grad, ctx.device_mesh, placements, run_check=False), None, None


@leaf_call
def enter_region(x: Any, spec: LocalMapSpec, index: int) -> torch.Tensor:
    """This rank's local tensor of region input ``index`` (see ``_EnterRegion``)."""
    runner_spec("enter_region", spec, LocalMapSpec)
    return _EnterRegion.apply(x, spec, index)


class _ExitRegion(torch.autograd.Function):
    """A region output: local tensor -> DTensor per ``out_placements``; the cotangent ->
    the local cotangent the region's convention gives this rank."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: LocalMapSpec, index: int) -> Any:
        from torch.distributed.tensor import DTensor

        ctx.spec, ctx.index = spec, index
        device_mesh = device_mesh_for(spec.mesh, "exit_region")
        ctx.device_mesh = device_mesh
        placements = [p.to_dtensor() for p in spec.out_placements[index]]
        # Replicate outputs are not checked to agree across ranks (the eager SPMD simulation
        # checks it): that would cost a collective per output.
        # Contiguous, as the reference's outputs (assembled from pieces) are: the graph around
        # the region may view them.
        return DTensor.from_local(local.contiguous(), device_mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[torch.Tensor, None, None]:
        cotangent = redistribute_to(as_dtensor(grad, ctx.device_mesh), ctx.spec.cotangent_placement(ctx.index))
        return cotangent.to_local(), None, None


@leaf_call
def exit_region(local: torch.Tensor, spec: LocalMapSpec, index: int) -> Any:
    """Region output ``index`` as a DTensor (see ``_ExitRegion``)."""
    runner_spec("exit_region", spec, LocalMapSpec)
    return _ExitRegion.apply(local, spec, index)


@leaf_call
def run_scan_on_dtensors(body: Callable, *inputs_and_spec: Any) -> tuple[Any, ...]:
    """A lowered scan: the body (lowered) once per step in a Python loop; each step's slices
    are ``xs[i]`` and the per-step outputs are stacked, all as DTensor ops."""
    *inputs, spec = inputs_and_spec
    runner_spec("run_scan_on_dtensors", spec, ScanSpec)
    return run_scan_steps(without_module_hooks(body), inputs, spec)


def without_module_hooks(body: Callable) -> Callable:
    """A body module called through its ``forward``: a body runs once per step, and module
    hooks would run with it; DTensor's ``CommDebugMode`` (torch 2.9 .. 2.15) adds a forward
    hook at every call of a module, so counting collectives fails at a module's second call."""
    if not isinstance(body, torch.nn.Module):
        return body
    forward = body.forward

    def step(*inputs: Any) -> Any:
        return forward(*inputs)

    step.__name__ = step.__qualname__ = type(body).__name__
    return step


@leaf_call
def run_in_profiler_scope(body: Callable, *inputs_and_spec: Any) -> Any:
    """A lowered named scope: ``body(*inputs)`` under ``torch.profiler.record_function(name)``."""
    *inputs, spec = inputs_and_spec
    runner_spec("run_in_profiler_scope", spec, ScopeSpec)
    with torch.profiler.record_function(spec.name):
        return without_module_hooks(body)(*inputs)


@leaf_call
def replicated(value: Any, mesh: Mesh) -> Any:
    """A tensor every rank computes whole (a graph's tensor constant, a factory op's result,
    made without DTensor inputs) as a replicated DTensor on ``mesh``'s DeviceMesh: DTensor ops
    refuse a plain tensor next to DTensors."""
    if not isinstance(value, torch.Tensor):
        return value
    return as_dtensor(value, device_mesh_for(mesh, "replicated"))


@leaf_call
def run_replicated(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` for an op DTensor cannot place: every DTensor argument
    redistributed to ``Replicate`` on every mesh axis (a pending sum reduced, shards gathered),
    ``op`` run on the local tensors (each rank computes the whole result), each tensor output
    a replicated DTensor. Without DTensor arguments (made by factory ops) ``op`` runs as is."""
    from torch.distributed.tensor import DTensor, Replicate

    dtensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not dtensors:
        return op(*args, **kwargs)
    device_mesh = dtensors[0].device_mesh
    whole = [Replicate()] * device_mesh.ndim

    def local(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        if value.device_mesh != device_mesh:
            raise ValueError(f"run_replicated({op}): its DTensor arguments are on different meshes")
        gathered = value.redistribute(device_mesh, whole)
        return _laid_out_as(gathered.to_local(), gathered.stride())

    def wrap(value: Any) -> Any:
        return DTensor.from_local(value, device_mesh, whole, run_check=False) if isinstance(value, torch.Tensor) else value

    args, kwargs = pytree.tree_map(local, (args, kwargs))
    return pytree.tree_map(wrap, op(*args, **kwargs))


def _laid_out_as(local: torch.Tensor, stride: tuple) -> torch.Tensor:
    """``local`` (a gathered value) in the layout ``stride`` its DTensor states, the layout the
    op was traced on: an op whose outputs follow its inputs' layout (CPU flash attention's
    gradients) would otherwise return a layout the graph's next ``view`` cannot read. A stated
    layout that is not dense (stride 0) is left as gathered."""
    if local.stride() == tuple(stride) or not _dense(local.shape, stride):
        return local
    return local.new_empty_strided(local.shape, stride).copy_(local)


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely, each element once (a permutation of the
    contiguous layout)."""
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda pair: pair[1]):
        if size != 1:
            if step != expected:
                return False
            expected *= size
    return True


# Checks that read only their tensor arguments' metadata (sizes, strides, dtype, layout), never
# their values: run on a storage-less stand-in with the DTensor's global metadata (no collective).
_METADATA_CHECKS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


@leaf_call
def check_on_dtensors(op: Any, *args: Any, **kwargs: Any) -> None:
    """``op(*args, **kwargs)`` for an op returning no tensor that DTensor has no strategy for
    (an assertion): what the traced program checked of a global value is checked of the
    DTensor's global value. A metadata check (``_METADATA_CHECKS``) runs on a ``meta`` tensor
    of the DTensor's global shape, stride and dtype (no collective; like every meta kernel it
    does not compare the device); any other op on the gathered value (``run_replicated``)."""
    from torch.distributed.tensor import DTensor

    if op not in _METADATA_CHECKS:
        return run_replicated(op, *args, **kwargs)

    def global_stand_in(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")

    args, kwargs = pytree.tree_map(global_stand_in, (args, kwargs))
    return op(*args, **kwargs)


@leaf_call
def run_by_inplace_rule(inplace: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The functional op of ``inplace`` (``fill.Scalar`` of ``fill_.Scalar``): ``inplace`` on a
    copy of ``x`` (DTensor runs ``clone`` and ``inplace``; the copy keeps ``x``'s layout)."""
    return inplace(x.clone(), *args, **kwargs)


@leaf_call
def run_with_replicated_parameters(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op`` (a norm's backward, ``DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT``) with
    its weight and bias DTensors replicated first: DTensor 2.9 runs the local kernel on them as
    they arrive, and a shard of a normalized-shape parameter is refused. Their gradients' layouts
    follow the input's, as DTensor's rule says."""
    from torch.distributed.tensor import DTensor, Replicate

    args = list(args)
    for position in DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT[str(op)]:
        value = args[position] if position < len(args) else None
        if isinstance(value, DTensor):
            args[position] = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
    return op(*args, **kwargs)
