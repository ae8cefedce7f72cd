"""``local_map_hop``: a region whose body runs on each device's local shard.

``hops.local_map(fn, mesh=..., in_placements=..., out_placements=...)`` returns a callable
taking *global* tensors. Calling it emits one node
``hops_local_map(body, *flat_tensor_inputs, spec)`` whose ``spec`` is a typed
``LocalMapSpec`` holding the mesh and every placement. The body sees each device's local
tensors; outputs are the global tensors the per-device results form under
``out_placements``.

Rules:
- eager: an SPMD simulation (one body call per device on its shard; outputs reassembled,
  ``Replicate`` outputs checked to agree): the reference every lowering is compared with;
- fake: local shapes from global shapes and placements, the body on them, global output shapes;
- functionalization / proxy: the body must not mutate or alias its inputs (refused, naming them);
  the body is traced into a subgraph named after the user function;
- autograd: eager, the simulation runs under autograd, with each input's per-device pieces
  made by a function whose backward assembles their gradients per ``in_grad_placements``
  (derived when not given: replicated -> ``Partial``, sharded -> same shard). Traced, the
  body's joint is split: the forward region also returns the residuals its backward reads,
  each laid out per device (a device's residual is its block of dim 0, ``Shard(0)`` on every
  mesh axis), and the backward is another ``local_map_hop`` from the primals it reads, the
  residuals and the output cotangents to the input gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hops import _dynamo, _layout
from hops._base import BodyHOP, call_body_hop, set_trace_key
from hops._subgraph import named
from hops._subgraph import body_name, rename_inner_function
from hops.specs import LocalMapSpec, Mesh, Placement, Shard, is_placement_like, placements_tuple

__all__ = ["local_map", "local_map_hop"]


class LocalMap(BodyHOP):
    """HOP ``hops_local_map(body, *tensors, spec)``."""

    spec_type = LocalMapSpec

    def __init__(self) -> None:
        super().__init__("hops_local_map")

    def check(self, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> None:
        _check_call(body, tensors, spec)

    def body_inputs(self, tensors: Sequence[Any], spec: LocalMapSpec) -> tuple:
        """What the body sees of ``tensors``: device 0's local shards."""
        return tuple(_local_examples(tensors, spec))

    def outputs_from_body(self, outputs: Sequence[Any], tensors: Sequence[Any], spec: LocalMapSpec) -> tuple:
        name = "local_map"
        _check_outputs(name, outputs, spec)
        return tuple(
            output.new_empty(_layout.global_shape(output.shape, placements, spec.mesh, f"local_map: output {j}"))
            for j, (output, placements) in enumerate(zip(outputs, spec.out_placements))
        )

    def run(self, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> tuple:
        return simulate(body, tensors, spec)

    def fold_lifted(self, tensors: Sequence[Any], spec: LocalMapSpec, lifted: Sequence[Any]) -> tuple[list, LocalMapSpec]:
        return [*tensors, *lifted], spec.with_lifted(lifted)

    # Traced autograd: residuals leave the forward region laid out per device.

    def forward_spec(self, spec: LocalMapSpec, residuals: Sequence[Any]) -> LocalMapSpec:
        per_device = _per_device(spec.mesh)
        return LocalMapSpec(
            spec.mesh,
            spec.in_placements,
            spec.out_placements + tuple(per_device for _ in residuals),
            spec.in_grad_placements,
        )

    def backward_spec(self, spec, split, residuals, needs_grad, present) -> LocalMapSpec:
        from hops.specs import transpose_placement

        per_device = _per_device(spec.mesh)
        return LocalMapSpec(
            spec.mesh,
            (
                *(spec.in_placements[i] for i in split.primals_in_backward),
                *(per_device for _ in residuals),
                *(
                    tuple(transpose_placement(p, f"out_placements[{j}]") for p in spec.out_placements[j])
                    for j in present
                ),
            ),
            tuple(spec.grad_placement(i) for i, need in enumerate(needs_grad) if need),
        )

    def residuals_out(self, forward: Callable, num_outputs: int) -> Callable:
        # A 0-d residual has no dim 0 to lay devices along: it leaves as shape (1,).
        def forward_with_residuals(*tensors: Any) -> tuple:
            results = forward(*tensors)
            return (*results[:num_outputs], *(r.reshape(1) if r.dim() == 0 else r for r in results[num_outputs:]))

        return named(forward_with_residuals, body_name(forward))

    def residuals_in(self, residuals: Sequence[Any]) -> list[Callable]:
        return [(lambda value: value.reshape(())) if r.dim() == 0 else (lambda value: value) for r in residuals]


local_map_hop = LocalMap()


def _per_device(mesh: Mesh) -> tuple[Placement, ...]:
    """The layout of a value each device computes for itself: device ``d`` (row-major) holds
    block ``d`` of dim 0."""
    return tuple(Shard(0) for _ in mesh.shape)


def _check_call(body: Any, tensors: Sequence[Any], spec: LocalMapSpec) -> None:
    if len(tensors) != len(spec.in_placements):
        raise ValueError(
            f"local_map {body_name(body)}: {len(tensors)} tensor inputs but in_placements has "
            f"{len(spec.in_placements)} entries"
        )
    for i, (tensor, placements) in enumerate(zip(tensors, spec.in_placements)):
        what = f"local_map {body_name(body)}: input {i}"
        if isinstance(tensor, torch.fx.Proxy):
            continue
        if placements is None:
            if isinstance(tensor, torch.Tensor):
                raise ValueError(f"{what} is a tensor but its in_placements entry is None")
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a Tensor, got {type(tensor).__name__}")
        _layout.local_shape(tensor.shape, placements, spec.mesh, what)


# --------------------------------------------------------------------------- public API

def _is_placements_leaf(value: Any) -> bool:
    """A placements tuple (or None) in a normalized placements tree."""
    return value is None or (
        type(value) is tuple and len(value) > 0 and all(isinstance(p, Placement) for p in value)
    )


def _normalize(tree: Any, mesh: Mesh, where: str) -> Any:
    """Placements tree with every leaf a tuple of this package's placements (or None).

    Done once in ``local_map``, so each call (possibly traced by Dynamo) only walks
    ready-made values.
    """
    if tree is None:
        return None
    if isinstance(tree, (tuple, list)) and tree and all(is_placement_like(p) for p in tree):
        return placements_tuple(tree, mesh, where)
    if isinstance(tree, (tuple, list)):
        return tuple(_normalize(t, mesh, f"{where}[{i}]") for i, t in enumerate(tree))
    if isinstance(tree, dict):
        return {k: _normalize(v, mesh, f"{where}[{k!r}]") for k, v in tree.items()}
    raise TypeError(
        f"{where} must be a placements tuple (one placement per mesh axis {mesh.axis_names}), "
        f"None, or a tuple/list/dict of those, got {tree!r}"
    )


def _broadcast(prefix: Any, tree: Any, where: str) -> list[Any]:
    """Expand a pytree prefix of placements over ``tree``'s leaves."""
    if _is_placements_leaf(prefix):
        return [prefix] * len(pytree.tree_leaves(tree))
    if isinstance(prefix, (tuple, list)) and isinstance(tree, (tuple, list)) and len(prefix) == len(tree):
        return [p for i, (sub, t) in enumerate(zip(prefix, tree)) for p in _broadcast(sub, t, f"{where}[{i}]")]
    if isinstance(prefix, dict) and isinstance(tree, dict) and prefix.keys() == tree.keys():
        return [p for k in tree for p in _broadcast(prefix[k], tree[k], f"{where}[{k!r}]")]
    raise ValueError(
        f"{where} does not match its argument: expected a placements tuple, None, or the same "
        f"structure as the argument ({type(tree).__name__}), got {prefix!r}"
    )


def local_map(
    fn: Callable,
    *,
    mesh: Mesh,
    in_placements: Sequence[Any],
    out_placements: Any,
    in_grad_placements: Sequence[Any] | None = None,
) -> Callable:
    """Wrap ``fn`` so that it runs on local shards of global tensors (DTensor's ``local_map``).

    ``in_placements`` has one entry per positional argument: a tuple with one placement per
    mesh axis (applied to every tensor in that argument), ``None`` for a non-tensor argument,
    or a pytree matching the argument. ``out_placements`` mirrors the structure ``fn``
    returns, with a placements tuple per tensor. ``in_grad_placements`` (same structure as
    ``in_placements``) lays out input gradients; by default replicated inputs get ``Partial``
    gradients and sharded inputs keep their shard. Bad placements raise ``TypeError`` /
    ``ValueError`` naming ``fn`` and the argument.
    """
    name = body_name(fn)
    if not callable(fn):
        raise TypeError(f"local_map(fn=...) must be callable, got {type(fn).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"local_map({name}): mesh must be a hops.Mesh, got {type(mesh).__name__}")
    if not isinstance(in_placements, (tuple, list)):
        raise TypeError(
            f"local_map({name}): in_placements must have one entry per positional argument, got {in_placements!r}"
        )
    if in_grad_placements is not None and (
        not isinstance(in_grad_placements, (tuple, list)) or len(in_grad_placements) != len(in_placements)
    ):
        raise ValueError(
            f"local_map({name}): in_grad_placements must have one entry per positional argument "
            f"({len(in_placements)}), got {in_grad_placements!r}"
        )
    # Validate and normalize every placement now, before any call.
    in_placements = _normalize(tuple(in_placements), mesh, f"local_map({name}) in_placements")
    if in_grad_placements is not None:
        in_grad_placements = _normalize(tuple(in_grad_placements), mesh, f"local_map({name}) in_grad_placements")
    out_placements = _normalize(out_placements, mesh, f"local_map({name}) out_placements")
    out_leaves, out_treespec = pytree.tree_flatten(out_placements, is_leaf=_is_placements_leaf)
    if not out_leaves or any(p is None for p in out_leaves):
        raise ValueError(f"local_map({name}): out_placements needs a placements tuple for every output")

    make_body = rename_inner_function(_make_body, "body", body_name(fn))

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if len(args) != len(in_placements):
            raise TypeError(
                f"local_map({name}): called with {len(args)} positional arguments but in_placements "
                f"has {len(in_placements)} entries"
            )
        leaves, args_treespec = pytree.tree_flatten(args)
        per_leaf = _broadcast(in_placements, args, f"local_map({name}) in_placements")
        grads_per_leaf = (
            None
            if in_grad_placements is None
            else _broadcast(in_grad_placements, args, f"local_map({name}) in_grad_placements")
        )
        tensor_positions = []
        for position, (leaf, placements) in enumerate(zip(leaves, per_leaf)):
            is_tensor = isinstance(leaf, torch.Tensor)
            if is_tensor and placements is None:
                raise ValueError(f"local_map({name}): tensor argument leaf {position} has no in_placements (None)")
            if not is_tensor and placements is not None:
                raise TypeError(
                    f"local_map({name}): in_placements gives placements for leaf {position}, which is "
                    f"a {type(leaf).__name__}, not a tensor; use None for non-tensor arguments"
                )
            if is_tensor:
                tensor_positions.append(position)
        spec = LocalMapSpec(
            mesh,
            tuple(per_leaf[p] for p in tensor_positions),
            tuple(out_leaves),
            None if grads_per_leaf is None else tuple(grads_per_leaf[p] for p in tensor_positions),
        )

        body = make_body(fn, leaves, tensor_positions, args_treespec, out_treespec, out_placements)
        set_trace_key(body, fn, args_treespec, out_treespec, [leaf for p, leaf in enumerate(leaves) if p not in tensor_positions])
        tensors = [leaves[p] for p in tensor_positions]
        flat_outputs = call_body_hop(
            local_map_hop,
            body,
            tensors,
            spec,
            what=f"local_map({name})",
            input_names=lambda i: f"argument leaf {tensor_positions[i]}",
            user_function=fn,
        )
        return pytree.tree_unflatten(list(flat_outputs), out_treespec)

    return call


def _make_body(
    fn: Callable,
    leaves: list[Any],
    tensor_positions: list[int],
    args_treespec: Any,
    out_treespec: Any,
    out_placements: Any,
) -> Callable:
    """The region body: ``fn`` on local tensors, with non-tensor arguments baked in, returning
    a flat tuple of tensors. ``local_map`` compiles ``body`` under the user function's name."""

    def body(*local_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        local_leaves = list(leaves)
        for position, tensor in zip(tensor_positions, local_tensors):
            local_leaves[position] = tensor
        result = fn(*pytree.tree_unflatten(local_leaves, args_treespec))
        try:
            # Flattened against the declared structure: dict key order does not matter.
            result_leaves = out_treespec.flatten_up_to(result)
        except (ValueError, TypeError):
            result_leaves = None
        if result_leaves is None or not all(isinstance(r, torch.Tensor) for r in result_leaves):
            raise TypeError(
                f"local_map({body_name(fn)}) returned "
                f"{pytree.tree_map(lambda r: 'Tensor' if isinstance(r, torch.Tensor) else type(r).__name__, result)}, "
                f"which does not match out_placements {out_placements!r}"
            )
        return tuple(result_leaves)

    return body


# --------------------------------------------------------------------------- eager


def _check_outputs(name: str, outputs: Sequence[Any], spec: LocalMapSpec) -> tuple[torch.Tensor, ...]:
    if len(outputs) != len(spec.out_placements):
        raise TypeError(
            f"local_map {name}: the body must return {len(spec.out_placements)} tensors "
            f"(one per out_placements entry), got {len(outputs)}"
        )
    for j, (output, placements) in enumerate(zip(outputs, spec.out_placements)):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"local_map {name}: output {j} is a {type(output).__name__}, not a tensor")
        _layout.check_rank(output.dim(), placements, spec.mesh, f"local_map {name}: output {j}")
    return tuple(outputs)


class _Distribute(torch.autograd.Function):
    """A global tensor -> each device's local piece (row-major device order). The backward
    assembles the pieces' gradients into the global gradient per the gradient placements:
    a pending sum adds them, a shard concatenates them, a replicated gradient must agree."""

    @staticmethod
    def forward(ctx: Any, spec: LocalMapSpec, index: int, what: str, tensor: torch.Tensor):
        ctx.spec, ctx.index, ctx.what = spec, index, what
        placements, mesh = spec.in_placements[index], spec.mesh
        return tuple(
            _layout.shard_for_device(tensor, placements, mesh, coordinate)
            for coordinate in _layout.device_coordinates(mesh)
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        if all(g is None for g in grads):
            return None, None, None, None
        like = next(g for g in grads if g is not None)
        mesh = ctx.spec.mesh
        pieces = {
            coordinate: torch.zeros_like(like) if grad is None else grad
            for coordinate, grad in zip(_layout.device_coordinates(mesh), grads)
        }
        # Derived lazily: an input whose gradient is never asked for needs no layout for it.
        grad_placements = ctx.spec.grad_placement(ctx.index)
        grad = _layout.assemble(pieces, grad_placements, mesh, f"the gradient of {ctx.what}")
        return None, None, None, grad


def simulate(body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> tuple[torch.Tensor, ...]:
    """Run ``body`` once per device on its local shards and assemble the global outputs.

    Differentiable: run above autograd, the gradient of each input is assembled from its
    pieces' gradients per the spec's gradient placements."""
    name = body_name(body)
    coordinates = _layout.device_coordinates(spec.mesh)
    per_input = []
    for i, (t, placements) in enumerate(zip(tensors, spec.in_placements)):
        if placements is None:
            per_input.append([t] * len(coordinates))
        else:
            per_input.append(_Distribute.apply(spec, i, f"local_map {name} input {i}", t))
    pieces: list[dict[tuple[int, ...], torch.Tensor]] = [{} for _ in spec.out_placements]
    for d, coordinate in enumerate(coordinates):
        local = [pieces_of_input[d] for pieces_of_input in per_input]
        local_tensors = [t for t in local if isinstance(t, torch.Tensor)]
        versions = [t._version for t in local_tensors]
        outputs = _check_outputs(name, pytree.tree_leaves(body(*local)), spec)
        for i, (t, version) in enumerate(zip(local_tensors, versions)):
            if t._version != version:
                raise ValueError(f"{name} writes into its input {i} in place; a region body must be functional")
        for j, output in enumerate(outputs):
            pieces[j][coordinate] = output
    return tuple(
        _layout.assemble(p, placements, spec.mesh, f"local_map {name}: output {j}")
        for j, (p, placements) in enumerate(zip(pieces, spec.out_placements))
    )


@local_map_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *tensors_and_spec: Any):
    tensors, spec = local_map_hop.split_args(tensors_and_spec)
    return local_map_hop.run(body, tensors, spec)


# --------------------------------------------------------------------------- fake


def _local_examples(tensors: Sequence[Any], spec: LocalMapSpec) -> list[Any]:
    """Device 0's local tensors: what the body is traced with (tracers' stand-ins get fresh
    tensors of the local shape; real tensors their real shard)."""
    origin = (0,) * spec.mesh.ndim
    examples = []
    for i, (t, placements) in enumerate(zip(tensors, spec.in_placements)):
        if placements is None or not isinstance(t, torch.Tensor):
            examples.append(t)
        elif isinstance(t, (FakeTensor, FunctionalTensor)):
            examples.append(t.new_empty(_layout.local_shape(t.shape, placements, spec.mesh, f"input {i}")))
        else:
            examples.append(_layout.shard_for_device(t, placements, spec.mesh, origin))
    return examples


@local_map_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, body: Callable, *tensors_and_spec: Any):
    return local_map_hop.fake_rule(mode, body, *tensors_and_spec)


# --------------------------------------------------------------------------- functionalize


@local_map_hop.py_functionalize_impl
def _functionalize(ctx: Any, body: Callable, *tensors_and_spec: Any):
    return local_map_hop.functionalize_rule(ctx, body, *tensors_and_spec)


# --------------------------------------------------------------------------- proxy


@local_map_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, body: Callable, *tensors_and_spec: Any):
    return local_map_hop.proxy_rule(mode, body, *tensors_and_spec)


# --------------------------------------------------------------------------- autograd


@local_map_hop.py_impl(DispatchKey.Autograd)  # always: a closed-over tensor may need grad when no operand does
def _autograd(body: Callable, *tensors_and_spec: Any):
    return local_map_hop.autograd_rule(body, *tensors_and_spec)


# --------------------------------------------------------------------------- dynamo

_dynamo.register_subgraph_hop(local_map_hop)
