"""Target ``"jax"``: this package's HOPs rewritten into calls of functions on jax values.

One rule per HOP; each rewrites its node in place into a call of a runner below (the node keeps
its name, operands and spec; a body stays a subgraph, lowered already, which the runner runs
through ``passes.jax.graph.jax_function``):

- an annotation -> ``sharding_constraint``: ``jax.lax.with_sharding_constraint`` to the spec's
  ``NamedSharding`` (Shardy's ``sdy.sharding_constraint``), its gradient constrained to the
  spec's gradient layout (a ``jax.custom_vjp``), as the backward annotation of a traced joint does;
- a ``local_map`` region -> ``local_map``: ``jax.shard_map`` of its (active) body, in/out specs
  from the placements (``sdy.manual_computation``); a ``Partial("sum")`` input enters on the
  first device along its axis (the others hold zeros) and a ``Partial`` output leaves reduced
  (``psum``; ``pmean`` / ``pmax`` / ``pmin``), as the XLA target does; under a random key its
  random ops draw per block: each device folds its position along the input-sharded axes into
  the region's key (``sharded_axes``);
- a scan -> ``scan``: ``jax.lax.scan`` (``reverse``, ``unroll``; ``remat`` -> ``jax.checkpoint``
  of the step), its body keeping every nested HOP (lowered by these same rules);
- a named scope -> ``named_scope``: its body inside ``jax.named_scope`` (the scope's name reaches
  the op locations of the lowered program);
- a kernel -> its ``jax=`` implementation on the jax values when given (a Pallas kernel, say;
  jax differentiates it, so one jax cannot differentiate comes as a ``jax.custom_vjp``), else
  its torch function, traced with ``make_fx`` for the operands' shapes and dtypes and lowered
  through this target (once per signature): ``jax.grad`` differentiates that graph (a kernel's
  ``backward=`` is for torch's autograd); einsum -> ``jnp.einsum``.

Nothing here imports jax until a lowered graph runs: registering the table is light.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from hops.einsum import einsum_kernel, einsum_linear_kernel
from hops.kernel import Kernel, KernelParams
from hops.local_map import local_map_hop
from hops.lowering import split_scan_operands
from hops.named_scope import ScopeSpec, named_scope_hop
from hops.scan import ScanSpec, scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import Mesh, Partial, Shard, ShardingSpec
from passes._infra import HopRulePass, PassError, body_attr, body_module, graph_modules, register_rule, typed_spec
from passes.inline import kernel_call, region_operands
from passes.jax.aten import has_key, is_random, random_key, split_key
from passes.jax.graph import RUNNERS, jax_function

TARGET = "jax"


def runner(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as what a lowered node may call on jax values."""
    RUNNERS.add(function)
    return function


# ---------------------------------------------------------------- meshes and specs


@functools.lru_cache(maxsize=None)
def jax_mesh(mesh: Mesh) -> Any:
    """``jax.sharding.Mesh`` over ``mesh``'s device ids among ``jax.devices()``; ``ValueError``
    naming the mesh when this process has too few devices."""
    import jax
    import numpy as np

    devices = jax.devices()
    if max(mesh.device_ids) >= len(devices):
        raise ValueError(
            f"lower_to_jax: {mesh!r} needs device ids up to {max(mesh.device_ids)} but jax has {len(devices)} "
            f"device(s); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} before jax is imported"
        )
    ordered = np.array([devices[i] for i in mesh.device_ids], dtype=object).reshape(mesh.shape)
    return jax.sharding.Mesh(ordered, mesh.axis_names)


def partition_spec(mesh: Mesh, placements: tuple, ndim: int | None = None) -> Any:
    """jax's ``PartitionSpec`` of a value with ``placements``: dims past the last sharded one
    are left out (replicated), so the rank is needed only to resolve a negative ``Shard`` dim;
    ``Partial`` axes count as replicated (the reduction is the region's business)."""
    import jax

    dims = [p.dim if p.dim >= 0 or ndim is None else p.dim + ndim for p in placements if isinstance(p, Shard)]
    per_dim: list[list[str]] = [[] for _ in range(max(dims, default=-1) + 1)]
    for axis, placement in zip(mesh.axis_names, placements):
        if isinstance(placement, Shard):
            per_dim[placement.dim if placement.dim >= 0 or ndim is None else placement.dim + ndim].append(axis)
    return jax.sharding.PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in per_dim))


def named_sharding(spec: ShardingSpec, ndim: int) -> Any:
    import jax

    return jax.sharding.NamedSharding(jax_mesh(spec.mesh), partition_spec(spec.mesh, spec.placements, ndim))


# ---------------------------------------------------------------- annotation


@runner
def sharding_constraint(x: Any, spec: ShardingSpec) -> Any:
    """``x`` constrained to ``spec``'s layout; its cotangent to ``spec.grad``'s."""
    import jax

    value = named_sharding(spec, x.ndim)
    if spec.grad_placements is None or spec.grad_placements == spec.placements:
        return jax.lax.with_sharding_constraint(x, value)
    gradient = named_sharding(spec.grad, x.ndim)

    @jax.custom_vjp
    def constrain(v):
        return jax.lax.with_sharding_constraint(v, value)

    def forward(v):
        return constrain(v), None

    def backward(_, g):
        return (jax.lax.with_sharding_constraint(g, gradient),)

    constrain.defvjp(forward, backward)
    return constrain(x)


@register_rule(TARGET, sharding_annotation_hop)
def lower_sharding_annotation(node: fx.Node) -> None:
    spec = typed_spec(node, TARGET, ShardingSpec)
    if spec.has_partial or spec.grad.has_partial:
        raise PassError(
            f"lower_to_jax: {node.format_node()}: {spec!r} has a Partial placement; a jax sharding describes "
            "a whole value, so a sharding annotation cannot be Partial"
        )
    node.target = sharding_constraint  # same args: (x, spec)


# ---------------------------------------------------------------- local_map


_REDUCE = {"sum": "psum", "avg": "pmean", "max": "pmax", "min": "pmin"}


@runner
def local_map(body: fx.GraphModule, *operands_and_spec: Any) -> tuple[Any, ...]:
    """The region as ``jax.shard_map`` of its body (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    *operands, spec = operands_and_spec
    mesh = jax_mesh(spec.mesh)
    run_body = jax_function(body)
    tensor_positions = [i for i, p in enumerate(spec.in_placements) if p is not None]
    tensors = [operands[i] for i in tensor_positions]
    in_specs = tuple(partition_spec(spec.mesh, spec.in_placements[i], operands[i].ndim) for i in tensor_positions)
    # Under a random key, the body's draws come from a key of the region's own (a replicated
    # operand), which each device folds its position into along the axes it holds a different
    # block on: see ``sharded_axes``.
    keyed = has_key() and _draws_random_numbers(body)
    if keyed:
        tensors.append(split_key(1)[0])
        in_specs += (jax.sharding.PartitionSpec(),)
        folded = sharded_axes(spec)

    def local(*local_tensors: Any) -> tuple[Any, ...]:
        if keyed:
            *local_tensors, key = local_tensors
            for axis in folded:
                key = jax.random.fold_in(key, jax.lax.axis_index(axis))
        with random_key(key) if keyed else contextlib.nullcontext():
            return region(*local_tensors)

    def region(*local_tensors: Any) -> tuple[Any, ...]:
        inputs = list(operands)
        for i, value in zip(tensor_positions, local_tensors):
            for axis, placement in zip(spec.mesh.axis_names, spec.in_placements[i]):
                if isinstance(placement, Partial) and placement.reduce_op == "sum":
                    first = jax.lax.axis_index(axis) == 0  # one device holds the pending sum
                    value = jnp.where(first, value, jnp.zeros_like(value))
            inputs[i] = value
        outputs = run_body(*inputs)
        reduced = []
        for value, placements in zip(outputs, spec.out_placements):
            for axis, placement in zip(spec.mesh.axis_names, placements):
                if isinstance(placement, Partial):
                    value = getattr(jax.lax, _REDUCE[placement.reduce_op])(value, axis)
            reduced.append(value)
        return tuple(reduced)

    out_specs = tuple(partition_spec(spec.mesh, p) for p in spec.out_placements)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*tensors)


def sharded_axes(spec: Any) -> tuple[str, ...]:
    """The mesh axes a region's devices draw different random numbers along: those some input
    is ``Shard``ed over (each device along them computes a different block, and dropout over a
    sharded activation must mask each block independently, as the unsharded program would).
    Along the others every device holds the same inputs (``Replicate``, or the parts of a
    ``Partial`` sum, where one mask for all parts is dropout of the sum) and draws the same
    numbers, so a value replicated there stays replicated. A per-device output (a residual the
    backward region reads) does not count: it is no block of a global value."""
    return tuple(
        axis
        for k, axis in enumerate(spec.mesh.axis_names)
        if any(placements is not None and isinstance(placements[k], Shard) for placements in spec.in_placements)
    )


def _draws_random_numbers(body: fx.GraphModule) -> bool:
    return any(is_random(node.target) for module in graph_modules(body) for node in module.graph.nodes)


@register_rule(TARGET, local_map_hop)
def lower_local_map(node: fx.Node) -> None:
    operands, spec = region_operands(node, TARGET)
    body_module(node)
    node.target = local_map
    node.args = (body_attr(node), *operands, spec.options()[spec.active or 0] if spec.alternatives else spec)


# ---------------------------------------------------------------- scan


@runner
def scan(body: fx.GraphModule, *operands_and_spec: Any) -> tuple[Any, ...]:
    """The scan as ``jax.lax.scan``: ``(*final carry, *stacked ys)``."""
    import jax

    *operands, spec = operands_and_spec
    init, xs, additional = split_scan_operands(operands, spec)
    run_body = jax_function(body)
    num_carry = len(init)
    # Under a random key (random ops in the program), each step draws from a key of its own,
    # as torch's scan draws fresh numbers at each step: the body is traced once.
    keyed = has_key()
    if keyed:
        xs = [*xs, split_key(spec.length if spec.length is not None else xs[0].shape[0])]

    def step(carry: tuple, x: tuple) -> tuple:
        if keyed:
            *x, key = x
        with random_key(key) if keyed else contextlib.nullcontext():
            outputs = run_body(*carry, *x, *additional)
        return tuple(outputs[:num_carry]), tuple(outputs[num_carry:])

    if spec.remat:
        step = jax.checkpoint(step)
    carry, ys = jax.lax.scan(
        step, tuple(init), tuple(xs), length=None if xs else spec.length, reverse=spec.reverse, unroll=spec.unroll or 1
    )
    return (*carry, *ys)


@register_rule(TARGET, scan_hop)
def lower_scan(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScanSpec)
    body_module(node)
    node.target = scan  # same args; the body is lowered already


# ---------------------------------------------------------------- named scope


@runner
def named_scope(body: fx.GraphModule, *inputs_and_spec: Any) -> Any:
    """The body inside ``jax.named_scope(spec.name)``."""
    import jax

    *inputs, spec = inputs_and_spec
    with jax.named_scope(spec.name):
        return jax_function(body)(*inputs)


@register_rule(TARGET, named_scope_hop)
def lower_named_scope(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScopeSpec)
    body_module(node)
    node.target = named_scope


# ---------------------------------------------------------------- kernels and einsum


@functools.lru_cache(maxsize=None)
def _kernel_graph(kernel_hop: Kernel, signature: tuple, params: KernelParams) -> Callable[..., Any]:
    """The kernel's torch function traced for one signature, lowered to a JAX function."""
    from passes.jax import lower_to_jax

    examples = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in signature]
    kwargs = params.as_dict()
    graph = make_fx(lambda *tensors: kernel_hop.implementation(*tensors, **kwargs), tracing_mode="fake")(*examples)
    return lower_to_jax(graph)


_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


@functools.lru_cache(maxsize=None)
def _promised(kernel_hop: Kernel, signature: tuple, params: KernelParams) -> tuple[bool, tuple]:
    """What the kernel's ``abstract`` promises for one signature: (one tensor?, ((shape, dtype), ...))."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        examples = [torch.empty(shape, dtype=dtype) for shape, dtype in signature]
        result = kernel_hop.abstract_rule(*examples, **params.as_dict())
    flat = (result,) if isinstance(result, torch.Tensor) else tuple(result)
    return isinstance(result, torch.Tensor), tuple((tuple(o.shape), o.dtype) for o in flat)


def _call_jax_implementation(kernel_hop: Kernel, signature: tuple, tensors: list, params: KernelParams) -> Any:
    """The kernel's ``jax=`` on jax values; its result checked against ``abstract`` (the graph
    around the call was built from that promise: a different shape or dtype is refused here,
    naming the kernel, rather than computed with)."""
    result = kernel_hop.jax_implementation(*tensors, **params.as_dict())
    single, promised = _promised(kernel_hop, signature, params)
    flat = (result,) if not isinstance(result, (tuple, list)) else tuple(result)
    got = tuple((tuple(getattr(o, "shape", ())), _TORCH_DTYPES.get(str(getattr(o, "dtype", None)))) for o in flat)
    if got != promised:
        def show(metadata: tuple) -> str:
            return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in metadata)

        raise RuntimeError(
            f"{kernel_hop.describe()}: its jax implementation returned {show(got)} but its abstract rule "
            f"promises {show(promised)} for these inputs"
        )
    return flat[0] if single else flat


@functools.lru_cache(maxsize=None)
def kernel_runner(kernel_hop: Kernel) -> Callable[..., Any]:
    """What a lowered call of ``kernel_hop`` calls: its ``jax=`` implementation when given (jax
    differentiates it: a ``jax.custom_vjp`` brings its own backward), else the kernel's torch
    function on jax values, through this target's ATen table."""

    def run(*tensors_and_params: Any) -> Any:
        *tensors, params = tensors_and_params
        signature = tuple((tuple(t.shape), _TORCH_DTYPES[str(t.dtype)]) for t in tensors)
        if kernel_hop.jax_implementation is not None:
            return _call_jax_implementation(kernel_hop, signature, tensors, params)
        return _kernel_graph(kernel_hop, signature, params)(*tensors)

    run.__name__ = run.__qualname__ = f"jax_kernel_{kernel_hop.kernel_name}"
    return runner(run)


@register_rule(TARGET, Kernel)
def lower_kernel(node: fx.Node) -> None:
    kernel_hop, _, _ = kernel_call(node, TARGET)
    node.target = kernel_runner(kernel_hop)  # same args: (*tensors, params)


@runner
def einsum(equation: str, *operands: Any) -> Any:
    import jax.numpy as jnp

    return jnp.einsum(equation, *operands)


@register_rule(TARGET, einsum_kernel)
def lower_einsum(node: fx.Node) -> None:
    _, operands, params = kernel_call(node, TARGET)
    node.target = einsum
    node.args = (params.as_dict()["equation"], *operands)


@register_rule(TARGET, einsum_linear_kernel)
def lower_einsum_linear(node: fx.Node) -> None:
    _, (x, weight, bias), _ = kernel_call(node, TARGET)
    graph = node.graph
    with graph.inserting_before(node):
        product = graph.call_function(einsum, ("...i,oi->...o", x, weight))
    node.target = torch.ops.aten.add.Tensor
    node.args = (product, bias)


def lower_hops(gm: fx.GraphModule) -> fx.GraphModule:
    """Every HOP of ``gm`` and its bodies rewritten by this table (in place)."""
    HopRulePass(TARGET, name="lower_to_jax")(gm)
    return gm
