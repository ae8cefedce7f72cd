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
- autograd: the backward is another ``local_map_hop`` (inputs: primals and output cotangents;
  outputs: input gradients laid out per ``in_grad_placements``, derived when not given:
  replicated -> ``Partial``, sharded -> same shard). It recomputes the body's forward, so no
  activation crosses the region boundary.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._higher_order_ops.utils import (
    materialize_as_graph,
)
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
)

from hops import _dynamo, _layout
from hops._joint import is_tracing
from hops._subgraph import (
    body_name,
    copy_if_aliases,
    emit_body_node,
    functionalize_body_call,
    named,
    rename_inner_function,
    strip_detach,
    symbolic_trace_call,
)
from hops.specs import LocalMapSpec, Mesh, Placement, is_placement_like, placements_tuple

__all__ = ["local_map", "local_map_hop"]


class LocalMap(HigherOrderOperator):
    """HOP ``hops_local_map(body, *tensors, spec)``."""

    def __init__(self) -> None:
        super().__init__("hops_local_map")

    def __call__(self, body: Callable, *tensors_and_spec: Any):
        traced = symbolic_trace_call(self, (body, *tensors_and_spec))
        if traced is not None:
            return traced
        tensors, spec = _split(tensors_and_spec)
        if tensors and isinstance(tensors[-1], tuple):
            # Dynamo's node form: values the body closed over come as one trailing tuple.
            *tensors, lifted = tensors
            tensors, spec = (*tensors, *lifted), spec.with_lifted(lifted)
        _check_call(body, tensors, spec)
        return super().__call__(body, *tensors, spec)

    @staticmethod
    def body_example_args(tensors: Sequence[torch.Tensor], specs: Sequence[Any]) -> tuple:
        """What the body sees of ``tensors``: device 0's local shards."""
        return tuple(_local_examples(tensors, specs[-1]))


local_map_hop = LocalMap()


def _split(tensors_and_spec: Sequence[Any]) -> tuple[tuple[Any, ...], LocalMapSpec]:
    if not tensors_and_spec or not isinstance(tensors_and_spec[-1], LocalMapSpec):
        raise TypeError(
            "local_map_hop(body, *tensors, spec): the last argument must be a hops.LocalMapSpec, "
            f"got {type(tensors_and_spec[-1]).__name__ if tensors_and_spec else 'nothing'}"
        )
    return tuple(tensors_and_spec[:-1]), tensors_and_spec[-1]


def _check_call(body: Any, tensors: Sequence[Any], spec: LocalMapSpec) -> None:
    if not callable(body):
        raise TypeError(f"local_map_hop: body must be callable, got {type(body).__name__}")
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
    name = getattr(fn, "__name__", "fn")
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
        flat_outputs = local_map_hop(body, *(leaves[p] for p in tensor_positions), spec)
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
                f"local_map({body_name(fn)}) returned {pytree.tree_map(lambda r: type(r).__name__, result)}, "
                f"which does not match out_placements {out_placements!r}"
            )
        return tuple(result_leaves)

    return body


# --------------------------------------------------------------------------- eager


def _check_outputs(name: str, outputs: Any, spec: LocalMapSpec) -> tuple[torch.Tensor, ...]:
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(spec.out_placements):
        raise TypeError(
            f"local_map {name}: the body must return {len(spec.out_placements)} tensors "
            f"(one per out_placements entry), got {type(outputs).__name__}"
        )
    for j, (output, placements) in enumerate(zip(outputs, spec.out_placements)):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"local_map {name}: output {j} is a {type(output).__name__}, not a tensor")
        _layout.check_rank(output.dim(), placements, spec.mesh, f"local_map {name}: output {j}")
    return tuple(outputs)


def simulate(body: Callable, tensors: Sequence[torch.Tensor], spec: LocalMapSpec) -> tuple[torch.Tensor, ...]:
    """Run ``body`` once per device on its local shards and assemble the global outputs."""
    name = body_name(body)
    pieces: list[dict[tuple[int, ...], torch.Tensor]] = [{} for _ in spec.out_placements]
    for coordinate in _layout.device_coordinates(spec.mesh):
        local = [
            t if placements is None else _layout.shard_for_device(t, placements, spec.mesh, coordinate)
            for t, placements in zip(tensors, spec.in_placements)
        ]
        local_tensors = [t for t in local if isinstance(t, torch.Tensor)]
        versions = [t._version for t in local_tensors]
        outputs = _check_outputs(name, body(*local), spec)
        for i, (t, version) in enumerate(zip(local_tensors, versions)):
            if t._version != version:
                raise ValueError(
                    f"{name} mutates its argument input {i} in place; a region body must be functional"
                )
        for j, output in enumerate(outputs):
            if output.untyped_storage().nbytes() and any(
                torch._C._is_alias_of(output, t) for t in local_tensors
            ):
                raise ValueError(f"{name} returns output {j}, which aliases one of its arguments; return a copy")
            pieces[j][coordinate] = output
    return tuple(
        _layout.assemble(p, placements, spec.mesh, f"local_map {name}: output {j}")
        for j, (p, placements) in enumerate(zip(pieces, spec.out_placements))
    )


@local_map_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *tensors_and_spec: Any):
    tensors, spec = _split(tensors_and_spec)
    return simulate(body, tensors, spec)


# --------------------------------------------------------------------------- fake


def _local_examples(tensors: Sequence[torch.Tensor], spec: LocalMapSpec) -> list[torch.Tensor]:
    """Device 0's local tensors: what the body is traced with."""
    origin = (0,) * spec.mesh.ndim
    return [
        t if placements is None else _layout.shard_for_device(t, placements, spec.mesh, origin)
        for t, placements in zip(tensors, spec.in_placements)
    ]


@local_map_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, body: Callable, *tensors_and_spec: Any):
    tensors, spec = _split(tensors_and_spec)
    name = body_name(body)
    with mode:
        outputs = _check_outputs(name, body(*_local_examples(tensors, spec)), spec)
        return tuple(
            output.new_empty(
                _layout.global_shape(output.shape, placements, spec.mesh, f"local_map {name}: output {j}")
            )
            for j, (output, placements) in enumerate(zip(outputs, spec.out_placements))
        )


# --------------------------------------------------------------------------- functionalize


@local_map_hop.py_functionalize_impl
def _functionalize(ctx: Any, body: Callable, *tensors_and_spec: Any):
    tensors, spec = _split(tensors_and_spec)
    return functionalize_body_call(
        ctx, local_map_hop, body, tensors, (spec,), lambda unwrapped: _local_examples(unwrapped, spec)
    )


# --------------------------------------------------------------------------- proxy


@local_map_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, body: Callable, *tensors_and_spec: Any):
    tensors, spec = _split(tensors_and_spec)
    with disable_proxy_modes_tracing():
        outputs = local_map_hop(body, *tensors, spec)
        examples = _local_examples(tensors, spec)
    return emit_body_node(mode, local_map_hop, body, examples, (*tensors, spec), outputs)


# --------------------------------------------------------------------------- autograd


def _backward_body(body: Callable, n_inputs: int, needs_grad: Sequence[bool], has_cotangent: Sequence[bool]) -> Callable:
    """Local vjp of ``body``: (primals..., cotangents...) -> grads of the inputs that need them.

    ``cotangents`` are given for the outputs with ``has_cotangent`` only.

    Runs under the dispatch keys of the moment it is made (inside ``backward``, where
    autograd is live), wherever it is called from: the eager rule runs below autograd.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()

    def backward(*primals_and_cotangents: Any) -> tuple[torch.Tensor, ...]:
        primals = [
            p.detach().requires_grad_(need) if isinstance(p, torch.Tensor) else p
            for p, need in zip(primals_and_cotangents[:n_inputs], needs_grad)
        ]
        cotangents = primals_and_cotangents[n_inputs:]
        with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
            outputs = body(*primals)
        outputs = [o for o, given in zip(outputs, has_cotangent) if given]
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        wanted = [p for p, need in zip(primals, needs_grad) if need]
        grads = (
            torch.autograd.grad([o for o, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True)
            if pairs
            else [None] * len(wanted)
        )
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, wanted)]
        return copy_if_aliases(grads, primals_and_cotangents)

    return backward


class _LocalMapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, body: Callable, spec: LocalMapSpec, *tensors: torch.Tensor):
        ctx.body, ctx.spec = body, spec
        # An output nobody differentiates gets no cotangent, and needs no gradient layout.
        ctx.set_materialize_grads(False)
        # Non-tensor inputs (ints, SymInts) cannot be saved as tensors: keep them aside.
        ctx.non_tensors = [None if isinstance(t, torch.Tensor) else t for t in tensors]
        ctx.save_for_backward(*(t for t in tensors if isinstance(t, torch.Tensor)))
        with torch._C._AutoDispatchBelowAutograd():
            return local_map_hop(body, *tensors, spec)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        tensors = tuple(next(saved) if value is None else value for value in ctx.non_tensors)
        needs_grad = list(ctx.needs_input_grad[2:])
        has_cotangent = [c is not None for c in cotangents]
        if not any(has_cotangent):
            return (None,) * (2 + len(needs_grad))
        cotangents = tuple(c for c in cotangents if c is not None)
        backward_spec = ctx.spec.backward_spec(needs_grad, has_cotangent)
        backward_body = _backward_body(ctx.body, len(tensors), needs_grad, has_cotangent)
        if is_tracing((*tensors, *cotangents)):
            # Trace the vjp here, where autograd is live; traced inside the proxy rule it
            # would run below autograd and produce no gradients.
            with disable_proxy_modes_tracing():
                examples = _local_examples((*tensors, *cotangents), backward_spec)
            backward_body = strip_detach(
                materialize_as_graph(backward_body, tuple(examples), force_enable_grad=True)
            )
        backward_body = named(backward_body, f"{body_name(ctx.body)}_bwd")
        grads = iter(local_map_hop(backward_body, *tensors, *cotangents, backward_spec))
        return (None, None, *(next(grads) if need else None for need in needs_grad))


@local_map_hop.py_autograd_impl
def _autograd(body: Callable, *tensors_and_spec: Any):
    tensors, spec = _split(tensors_and_spec)
    return _LocalMapFunction.apply(body, spec, *tensors)


# --------------------------------------------------------------------------- dynamo

_dynamo.register_subgraph_hop(local_map_hop)
