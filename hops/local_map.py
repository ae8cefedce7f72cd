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

``hops.local_map`` in detail (its docstring is the contract):

- ``out_placements`` is for the *flattened* outputs, a tuple with one entry per output
  (placements, or ``None`` for a non-tensor output); a function returning one tensor may give
  its placements alone (``[Shard(0)]`` or ``(Shard(0), Replicate())``). A tree mirroring the
  output (a dict) works too. ``None`` (torch's default) is one output, replicated on every
  mesh axis.
- ``in_placements`` has one entry per flattened input (``None`` for a non-tensor), or one per
  positional argument applied to every tensor in it; ``None`` (or a ``None`` entry for a
  tensor) means the tensor is whole on every device (``Replicate``).
- ``in_grad_placements`` takes the same forms; by default a replicated input's gradient is a
  pending sum (``Partial``: each device contributes) and a sharded input's keeps its shard.
- ``redistribute_inputs`` reshards DTensor inputs to ``in_placements`` instead of refusing a
  mismatch (global tensors need no redistribution).
- ``alternatives`` are more placement options for the region, for a sharding solver to choose
  from (``passes.solve_placements``): each a ``hops.RegionPlacements`` or a dict with its
  fields (``in_placements``, ``out_placements``, ``in_grad_placements``, ``cost_hint``), given
  in the forms above. The main placements are option 0, what eager and the lowerings run until
  one is chosen (``LocalMapSpec.choose``). Options may give the body other local shapes (row-
  vs column-parallel): a traced region holds one body per option, each traced on its own
  shapes (by make_fx, torch.export and torch.compile alike); every option must give the same
  global outputs.
- Keyword arguments of the call are passed to ``func`` (tensors whole on every device). Plain
  tensors are global values; DTensor inputs run torch's own ``local_map`` on their shards.
  Without a mesh and without DTensor inputs, ``func`` runs as is (as torch's does).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hops import _compat, _dynamo, _inductor, _layout
from hops._body_hop.autograd import AutogradPlan
from hops._body_hop.body import version_counter
from hops._body_hop.body_record import across_calls_key, plan_body, set_trace_key, typed_values
from hops._body_hop.caches import cached_plan
from hops._body_hop.call import argument_names, call_body_hop
from hops._body_hop.flat_body import OptionBodies, option_body
from hops._body_hop.region import RegionHOP, RegionPlan
from hops._body_hop.subgraph import body_name, named, rename_inner_function
from hops._errors import call_prefix, hop_prefix, leaf_names
from hops.specs import (
    LocalMapSpec,
    Mesh,
    Placement,
    RegionPlacements,
    Replicate,
    Shard,
    is_placement_like,
    parse_groups,
    placements_tuple,
)

__all__ = ["local_map", "local_map_hop"]


class LocalMap(RegionHOP):
    """HOP ``hops_local_map(body, *tensors, spec)``."""

    spec_type = LocalMapSpec
    collectives_refusal = (
        "{what}: the body calls the collective {collective}; on plain tensors local_map computes every "
        "device's piece in this process, where a collective does not combine the pieces: return the "
        "per-device result with a Partial() out placement (the pieces are then summed), or pass DTensors "
        "to run torch's local_map"
    )

    def __init__(self) -> None:
        super().__init__("hops_local_map")

    def check(self, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> None:
        _check_call(body, tensors, spec)

    def body_operands(self, tensors: Sequence[Any], spec: LocalMapSpec) -> tuple:
        """What the body sees of ``tensors``: device 0's local shards."""
        return tuple(_local_examples(tensors, spec))

    def outputs_from_body(self, outputs: Sequence[Any], tensors: Sequence[Any], spec: LocalMapSpec) -> tuple:
        name = None
        _check_outputs(name, outputs, spec)
        shapes = [
            _layout.global_shape(output.shape, placements, spec.mesh, f"local_map: output[{j}]")
            for j, (output, placements) in enumerate(zip(outputs, spec.out_placements))
        ]
        return tuple(output.new_empty(shape) for output, shape in zip(outputs, shapes))

    def run(self, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> tuple:
        return simulate(body, tensors, spec)

    def resolve_spec(self, spec: LocalMapSpec, tensors: Sequence[Any], body_outputs: Sequence[Any]) -> LocalMapSpec:
        # A local piece has its global tensor's rank.
        return spec.for_ranks(
            [t.dim() if isinstance(t, torch.Tensor) else None for t in tensors],
            [o.dim() for o in body_outputs if isinstance(o, torch.Tensor)],
        )

    def fold_lifted(self, tensors: Sequence[Any], spec: LocalMapSpec, lifted: Sequence[Any]) -> tuple[list, LocalMapSpec]:
        return [*tensors, *lifted], spec.with_lifted(lifted)

    # Alternatives: one body per option, each traced on its own local shapes.

    def num_options(self, spec: LocalMapSpec) -> int:
        return len(spec.alternatives) or 1

    def option_spec(self, spec: LocalMapSpec, index: int) -> LocalMapSpec:
        return spec.choose(index) if spec.alternatives else spec

    def active_option(self, spec: LocalMapSpec) -> int:
        return spec.active or 0

    def option_failure(self, name: str, spec: LocalMapSpec, index: int, error: Exception) -> Exception:
        return _alternative_failure(name, spec, index, error)

    def check_options(self, name: str, steps: Sequence[Sequence[Any]], tensors: Sequence[Any], spec: LocalMapSpec) -> None:
        _check_option_outputs(name, steps, spec)

    def autograd_plan(self, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> AutogradPlan:
        if not spec.alternatives:
            return super().autograd_plan(body, tensors, spec)
        return cached_plan(lambda: _AlternativesPlan(self, body, tensors, spec), body, tensors, spec)

    # Traced autograd: residuals leave the forward region laid out per device.

    # Each placement option of a region (``alternatives``) gets its own forward and backward
    # placements, in the same order, so a solver's choice applies to both regions.

    def forward_spec(self, spec: LocalMapSpec, residuals: Sequence[Any]) -> LocalMapSpec:
        per_device = _per_device(spec.mesh)
        options = [
            LocalMapSpec(o.mesh, o.in_placements, o.out_placements + tuple(per_device for _ in residuals), o.in_grad_placements)
            for o in spec.options()
        ]
        # The residuals are marked: only the alternative that made them can read them.
        return LocalMapSpec.with_options(options, spec.active or 0, _hints(spec), len(residuals))

    def backward_spec(self, spec, split, residuals, needs_grad, present) -> LocalMapSpec:
        per_device = _per_device(spec.mesh)
        options = [
            LocalMapSpec(
                o.mesh,
                (
                    *(o.in_placements[i] for i in split.primals_in_backward),
                    *(per_device for _ in residuals),
                    *(o.cotangent_placement(j) for j in present),
                ),
                tuple(o.grad_placement(i) for i, need in enumerate(needs_grad) if need),
            )
            for o in spec.options()
        ]
        return LocalMapSpec.with_options(options, spec.active or 0)

    def residuals_out(self, forward: Callable, num_outputs: int) -> Callable:
        # A 0-d residual has no dim 0 to lay devices along: it leaves as shape (1,).
        def forward_with_residuals(*tensors: Any) -> tuple:
            results = forward(*tensors)
            return (*results[:num_outputs], *(r.reshape(1) if r.dim() == 0 else r for r in results[num_outputs:]))

        return named(forward_with_residuals, body_name(forward))

    def residuals_in(self, residuals: Sequence[Any]) -> list[Callable]:
        return [(lambda value: value.reshape(())) if r.dim() == 0 else (lambda value: value) for r in residuals]


local_map_hop = LocalMap()


class _AlternativesPlan(AutogradPlan):
    """The traced autograd of a region with alternatives: each option's body is split on its
    own local shapes (one ``RegionPlan`` per option); the forward region carries every
    option's forward body, the backward region every option's backward body, with the same
    options in the same order and the same one active, so a choice holds for both.

    What crosses from forward to backward must look the same whichever option ran: the
    primals any option's backward reads, and the residuals. Where the options' residuals
    differ in shape, each option packs its residuals into one flat buffer per dtype (padded
    to the largest option's), and its backward body unpacks them."""

    def __init__(self, hop: LocalMap, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> None:
        self.hop, self.spec = hop, spec
        self.active = spec.active or 0
        self.plans = [RegionPlan(hop, option_body(body, k), tensors, spec.choose(k)) for k in range(len(spec.alternatives))]
        first = self.plans[self.active]
        self.name, self.treespec, self.num_outputs = first.name, first.treespec, first.num_outputs
        for k, plan in enumerate(self.plans):
            if (plan.needs_grad, plan.differentiable) != (first.needs_grad, first.differentiable):
                raise ValueError(
                    f"local_map({self.name}): alternative {k}'s body connects other inputs to its differentiable outputs "
                    f"than alternative {self.active}'s; every alternative must compute the same function"
                )
        self.needs_grad = first.needs_grad
        self.primals = sorted(set().union(*(plan.split.primals_in_backward for plan in self.plans)))
        signatures = [[(tuple(r.shape), r.dtype) for r in plan.residuals] for plan in self.plans]
        self.packed = any(signature != signatures[0] for signature in signatures)
        if self.packed:
            if not all(isinstance(size, int) for signature in signatures for shape, _ in signature for size in shape):
                raise NotImplementedError(
                    f"local_map({self.name}): alternatives whose residuals differ in shape need static shapes to be "
                    "differentiated while traced (their residuals are packed into buffers of the largest size)"
                )
            self.dtypes = list(dict.fromkeys(dtype for signature in signatures for _, dtype in signature))
            self.lengths = [
                max(sum(math.prod(shape) for shape, d in signature if d == dtype) for signature in signatures)
                for dtype in self.dtypes
            ]
            self.residuals = [torch.empty((length,), dtype=dtype, device="meta") for dtype, length in zip(self.dtypes, self.lengths)]
        else:
            self.residuals = first.residuals
        self.forward_body: OptionBodies | None = None
        self.backward_bodies: dict[tuple[int, ...], OptionBodies] = {}

    def forward(self, tensors: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]]:
        if self.forward_body is None:  # made once: a plan reused across calls hands the same bodies on
            self.forward_body = OptionBodies([self._forward_body(plan) for plan in self.plans], self.active)
        results = self.hop(self.forward_body, *tensors, self.hop.forward_spec(self.spec, self.residuals))
        outputs, residuals = results[: self.num_outputs], results[self.num_outputs :]
        return outputs, [*(tensors[i] for i in self.primals), *residuals]

    def backward(self, saved: Sequence[Any], cotangents: Sequence[Any]) -> Sequence[Any]:
        if not any(self.needs_grad):
            return [None] * len(self.needs_grad)
        present = [i for i in self.plans[self.active].differentiable if cotangents[i] is not None]
        body = self.backward_bodies.get(tuple(present))
        if body is None:
            bodies = [self._backward_body(plan, present) for plan in self.plans]
            body = self.backward_bodies[tuple(present)] = OptionBodies(bodies, self.active)
        reads = _PrimalsRead(tuple(self.primals))
        spec = self.hop.backward_spec(self.spec, reads, self.residuals, self.needs_grad, present)
        grads = iter(self.hop(body, *saved, *(cotangents[i] for i in present), spec))
        return [next(grads) if need else None for need in self.needs_grad]

    def _forward_body(self, plan: RegionPlan) -> Callable:
        num_outputs, forward = self.num_outputs, plan.split.forward
        if not self.packed:
            return plan_body(named(self.hop.residuals_out(forward, num_outputs), self.name))
        dtypes, lengths = self.dtypes, self.lengths

        def forward_with_packed_residuals(*tensors: Any) -> tuple:
            results = forward(*tensors)
            outputs, residuals = results[:num_outputs], results[num_outputs:]
            like = outputs[0]
            buffers = []
            for dtype, length in zip(dtypes, lengths):
                pieces = [r.reshape(-1) for r in residuals if r.dtype == dtype]
                used = sum(p.numel() for p in pieces)
                if length > used:
                    pieces.append(like.new_zeros((length - used,), dtype=dtype))
                buffers.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
            return (*outputs, *buffers)

        return plan_body(named(forward_with_packed_residuals, self.name))

    def _backward_body(self, plan: RegionPlan, present: Sequence[int]) -> Callable:
        position = {i: p for p, i in enumerate(self.primals)}
        reads = [position[i] for i in plan.split.primals_in_backward]
        num_primals, num_residuals = len(self.primals), len(self.residuals)
        layout = [(tuple(r.shape), r.dtype) for r in plan.residuals]
        inner = plan._backward_body(present, [lambda value: value for _ in plan.residuals] if self.packed else None)
        dtypes = self.dtypes if self.packed else []

        def backward(*values: Any) -> tuple:
            primals = values[:num_primals]
            residuals = list(values[num_primals : num_primals + num_residuals])
            cotangents = values[num_primals + num_residuals :]
            if dtypes:  # unpack this option's residuals from the buffers
                buffers, offsets, unpacked = dict(zip(dtypes, residuals)), dict.fromkeys(dtypes, 0), []
                for shape, dtype in layout:
                    size = math.prod(shape)
                    unpacked.append(buffers[dtype][offsets[dtype] : offsets[dtype] + size].reshape(shape))
                    offsets[dtype] += size
                residuals = unpacked
            return inner(*(primals[p] for p in reads), *residuals, *cotangents)

        return plan_body(named(backward, f"{self.name}_bwd"))


class _PrimalsRead:
    """What ``backward_spec`` reads of a split: the primals the backward region takes."""

    def __init__(self, primals_in_backward: tuple[int, ...]) -> None:
        self.primals_in_backward = primals_in_backward


def _hints(spec: LocalMapSpec) -> list | None:
    return [o.cost_hint for o in spec.alternatives] or None


def _per_device(mesh: Mesh) -> tuple[Placement, ...]:
    """The layout of a value each device computes for itself: device ``d`` (row-major) holds
    block ``d`` of dim 0."""
    return tuple(Shard(0) for _ in mesh.shape)


def _tensor_names(i: int) -> str:
    """The HOP's tensor operands named as the node holds them (the public ``local_map``
    names them by key path in its arguments: ``args[0]['w']``)."""
    return f"tensors[{i}]"


def _check_call(
    body: Any,
    tensors: Sequence[Any],
    spec: LocalMapSpec,
    names: Callable[[int], str] = _tensor_names,
    entries: Callable[[int], str | None] = lambda i: None,
) -> None:
    """Refuse tensors the spec cannot lay out; ``names(i)`` names tensor ``i``, ``entries(i)``
    the in_placements entry that lays it out (``in_placements[0]['w']``), if known."""
    where = hop_prefix(local_map_hop, body)
    if len(tensors) != len(spec.in_placements):
        raise ValueError(
            f"{where}: {len(tensors)} tensor inputs but in_placements has "
            f"{len(spec.in_placements)} entries"
        )
    for i, (tensor, placements) in enumerate(zip(tensors, spec.in_placements)):
        what = f"{where}: {names(i)}"
        if isinstance(tensor, torch.fx.Proxy):
            continue
        if placements is None:
            if isinstance(tensor, torch.Tensor):
                raise ValueError(f"{what} is a tensor but its in_placements entry is None")
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a Tensor, got {type(tensor).__name__}")
        entry = entries(i)
        _layout.local_shape(tensor.shape, placements, spec.mesh, f"{what} ({entry})" if entry else what)
        # Each alternative gets its own body, traced on its own local shapes: they may differ,
        # but must exist (an even split where the layout needs one).
        for k, option in enumerate(spec.alternatives):
            _layout.local_shape(tensor.shape, option.in_placements[i], spec.mesh, f"{what} (alternative {k})")


def _check_option_outputs(name: str, steps: Sequence[Sequence[Any]], spec: LocalMapSpec) -> None:
    """Every alternative's body (its outputs ``steps[k]`` on its local shapes) must give the
    region the same global outputs: the program around the region is the same whichever a
    solver chooses."""
    if not spec.alternatives:
        return
    active = spec.active or 0

    def described(k: int) -> list[tuple]:
        option = spec.alternatives[k]
        if len(steps[k]) != len(option.out_placements):
            raise ValueError(
                f"local_map({name}): alternative {k}'s body returns {len(steps[k])} tensors for "
                f"{len(option.out_placements)} out_placements"
            )
        return [
            (tuple(_layout.global_shape(o.shape, p, spec.mesh, f"local_map({name}): output[{j}] (alternative {k})")), o.dtype)
            for j, (o, p) in enumerate(zip(steps[k], option.out_placements))
        ]

    expected = described(active)
    for k in range(len(spec.alternatives)):
        got = described(k)
        for j, (mine, theirs) in enumerate(zip(got, expected)):
            if mine != theirs:
                raise ValueError(
                    f"local_map({name}): output[{j}]: alternative {k} ({spec.alternatives[k]!r}) makes it of global "
                    f"shape {mine[0]} and dtype {mine[1]}, the active alternative {active} {theirs[0]} and {theirs[1]}; "
                    "every alternative must give the same global shapes"
                )


@torch.compiler.disable
def _check_alternatives_eagerly(
    name: str, body: Callable, tensors: Sequence[Any], spec: LocalMapSpec, names: Callable[[int], str] = _tensor_names
) -> None:
    """Run every alternative's body on fake local tensors (a tracer traces each anyway) and
    refuse one that fails on its local shapes or gives other global outputs. A body that
    cannot run on fake tensors (it reads tensor values in Python) is checked when traced.
    (Never traced by Dynamo: where a compiled call falls back to eager, the body runs here
    on fake tensors, not as code of the compiled graph.)"""
    from hops._body_hop.joint import is_tracing

    if not spec.alternatives or is_tracing(tensors):
        return
    active = spec.active or 0
    steps: list[Any] = [None] * len(spec.alternatives)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for k in [active, *(k for k in range(len(spec.alternatives)) if k != active)]:
            option = spec.choose(k)
            examples = [
                t if p is None or not isinstance(t, torch.Tensor)
                else torch.empty(
                    _layout.local_shape(t.shape, p, spec.mesh, f"local_map({name}): {names(i)} (alternative {k})"),
                    dtype=t.dtype,
                    device=t.device,
                )
                for i, (t, p) in enumerate(zip(tensors, option.in_placements))
            ]
            try:
                steps[k] = [o for o in pytree.tree_leaves(body(*examples)) if isinstance(o, torch.Tensor)]
            except Exception as error:
                if k == active:
                    return
                raise _alternative_failure(name, spec, k, error) from error
    _check_option_outputs(name, steps, spec)


def _alternative_failure(name: str, spec: LocalMapSpec, index: int, error: Exception) -> ValueError:
    return ValueError(
        f"local_map({name}): alternative {index} ({spec.alternatives[index]!r}): the body fails on that "
        f"alternative's local shapes: {type(error).__name__}: {error}"
    )


# --------------------------------------------------------------------------- public API


class LocalMapArgumentError(AssertionError, ValueError):
    """Placements that do not fit the call (as ``AssertionError``, the class torch's
    ``local_map`` raises for these, and as ``ValueError``)."""


class LocalMapTypeError(AssertionError, TypeError):
    """Placements given for a value that cannot take them (``AssertionError`` in torch)."""


def _is_placements(value: Any) -> bool:
    """One tensor's placements: a non-empty sequence of placements (ours or DTensor's)."""
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(is_placement_like(p) for p in value)


def _is_placements_leaf(value: Any) -> bool:
    """A placements tuple (or None) in a normalized placements tree."""
    return value is None or (
        type(value) is tuple and len(value) > 0 and all(isinstance(p, Placement) for p in value)
    )


def _normalize(tree: Any, mesh: Mesh, where: str) -> Any:
    """Placements tree with every leaf a tuple of this package's placements (or None)."""
    if tree is None:
        return None
    if _is_placements(tree):
        return placements_tuple(tree, mesh, where)
    if isinstance(tree, (tuple, list)):
        return tuple(_normalize(t, mesh, f"{where}[{i}]") for i, t in enumerate(tree))
    if isinstance(tree, dict):
        return {k: _normalize(v, mesh, f"{where}[{k!r}]") for k, v in tree.items()}
    raise LocalMapTypeError(
        f"{where} must be placements (one per mesh axis {mesh.axis_names}), None, or a "
        f"tuple/list/dict of those, got {tree!r}"
    )


def _broadcast(prefix: Any, tree: Any, where: str) -> list[Any]:
    """Expand a pytree prefix of placements over ``tree``'s leaves."""
    if _is_placements_leaf(prefix):
        return [prefix] * len(pytree.tree_leaves(tree))
    if isinstance(prefix, (tuple, list)) and isinstance(tree, (tuple, list)) and len(prefix) == len(tree):
        return [p for i, (sub, t) in enumerate(zip(prefix, tree)) for p in _broadcast(sub, t, f"{where}[{i}]")]
    if isinstance(prefix, dict) and isinstance(tree, dict) and prefix.keys() == tree.keys():
        return [p for k in tree for p in _broadcast(prefix[k], tree[k], f"{where}[{k!r}]")]
    raise LocalMapArgumentError(
        f"{where} does not match its argument: expected placements, None, or the same "
        f"structure as the argument ({type(tree).__name__}), got {prefix!r}"
    )


def _per_leaf(placements: Any, args: tuple, leaves: list, where: str) -> list[Any]:
    """One placements tuple (or None) per flattened argument leaf.

    As torch's ``local_map``: one entry per flattened input. Also accepted: one entry per
    positional argument, applied to every tensor in it (or a tree matching it)."""
    if placements is None:
        return [None] * len(leaves)
    if isinstance(placements, tuple) and len(placements) == len(leaves) and all(_is_placements_leaf(p) for p in placements):
        return list(placements)
    if isinstance(placements, tuple) and len(placements) == len(args):
        return _broadcast(placements, args, where)
    raise LocalMapArgumentError(
        f"{where} length {len(placements) if isinstance(placements, tuple) else placements!r} does not match "
        f"the number of input args {len(leaves)} (one entry per flattened input, or one per positional argument)"
    )


def _per_leaf_names(placements: Any, args: tuple, leaves: list, where: str) -> list[str | None]:
    """For each leaf ``_per_leaf`` gives placements, the key path of the entry they come
    from (``in_placements[0]['w']``, or ``in_placements[0]`` broadcast over a whole
    argument); None where no placements were given."""
    if placements is None:
        return [None] * len(leaves)
    if isinstance(placements, tuple) and len(placements) == len(leaves) and all(_is_placements_leaf(p) for p in placements):
        return [f"{where}[{i}]" for i in range(len(leaves))]
    return _broadcast_names(placements, args, where)


def _broadcast_names(prefix: Any, tree: Any, where: str) -> list[str]:
    """``_broadcast``'s leaves named by the key path of the prefix entry each comes from."""
    if _is_placements_leaf(prefix):
        return [where] * len(pytree.tree_leaves(tree))
    if isinstance(prefix, (tuple, list)):
        return [n for i, (sub, t) in enumerate(zip(prefix, tree)) for n in _broadcast_names(sub, t, f"{where}[{i}]")]
    return [n for k in tree for n in _broadcast_names(prefix[k], tree[k], f"{where}[{k!r}]")]


_OPTION_FIELDS = ("in_placements", "out_placements", "in_grad_placements", "cost_hint")


def _alternatives(name: str, alternatives: Any) -> list[dict[str, Any]]:
    """Each alternative as a dict of the ``RegionPlacements`` fields, as given (placements
    normalized per mesh later, like the main ones)."""
    if isinstance(alternatives, (RegionPlacements, dict)) or not isinstance(alternatives, (tuple, list)):
        raise LocalMapTypeError(
            f"local_map({name}): alternatives must be a list of hops.RegionPlacements or dicts, got {alternatives!r}"
        )
    options = []
    for k, option in enumerate(alternatives, start=1):
        if isinstance(option, RegionPlacements):
            option = {field: getattr(option, field) for field in _OPTION_FIELDS}
        if not isinstance(option, dict) or "out_placements" not in option or set(option) - set(_OPTION_FIELDS):
            raise LocalMapTypeError(
                f"local_map({name}): alternative {k} must be a hops.RegionPlacements or a dict with keys "
                f"{_OPTION_FIELDS} (out_placements required), got {option!r}"
            )
        hint = option.get("cost_hint")
        RegionPlacements((), (), None, hint)  # validates the hint
        # Text ("S(0)R, RR") is one entry per flattened input, as RegionPlacements reads it.
        options.append(
            {
                field: parse_groups(option[field], f"local_map({name}): alternative {k} {field}")
                if isinstance(option.get(field), str)
                else option.get(field)
                for field in _OPTION_FIELDS
            }
        )
    return options


def _mesh_of(mesh: Any, device_mesh: Any, name: str) -> Mesh | None:
    if mesh is not None and device_mesh is not None and mesh != device_mesh:
        raise LocalMapArgumentError(f"local_map({name}): mesh= and device_mesh= disagree: {mesh!r} vs {device_mesh!r}")
    given = mesh if mesh is not None else device_mesh
    if given is None or isinstance(given, Mesh):
        return given
    if hasattr(given, "mesh") and hasattr(given, "mesh_dim_names"):  # a DTensor DeviceMesh
        return Mesh.from_device_mesh(given)
    raise TypeError(f"local_map({name}): the mesh must be a hops.Mesh or a DeviceMesh, got {type(given).__name__}")


def local_map(
    func: Callable | None = None,
    out_placements: Any = None,
    in_placements: Any = None,
    in_grad_placements: Any = None,
    device_mesh: Any = None,
    *,
    redistribute_inputs: bool = False,
    mesh: Mesh | None = None,
    alternatives: Sequence[Any] = (),
) -> Callable:
    """Wrap ``func`` so that it runs on each device's local shards of global tensors.

    torch's ``local_map`` calling convention (``torch.distributed.tensor.experimental``), also
    as a decorator ``@local_map(out_placements=..., in_placements=..., device_mesh=...)``:

    - ``out_placements``: one entry per *flattened* output (placements, ``None`` for a
      non-tensor), a tree mirroring the output, or one output's placements alone; ``None``
      (the default): one output, replicated on every mesh axis.
    - ``in_placements``: one entry per flattened input, or per positional argument; ``None``
      means whole on every device (``Replicate``).
    - ``in_grad_placements``: each input's gradient layout, same forms; by default ``Partial``
      for a replicated input, the input's shard for a sharded one.
    - ``device_mesh`` (or ``mesh=``): a ``DeviceMesh`` or a ``hops.Mesh``.
    - ``redistribute_inputs``: reshard DTensor inputs to ``in_placements`` instead of refusing.
    - ``alternatives``: more placement options for a sharding solver (``hops.RegionPlacements``
      or dicts of its fields); the main placements are option 0.

    Returns a callable taking global tensors (keyword arguments reach ``func`` whole) and
    returning global outputs. Placements that do not fit raise errors naming ``func`` and the
    argument (torch's classes: ``AssertionError`` where it raises that, also catchable as
    ``ValueError`` / ``TypeError``). Details: the module docstring.

    >>> double = local_map(lambda x: 2 * x, out_placements=[Shard(0)], in_placements=([Shard(0)],), mesh=mesh)
    """
    if func is None:
        return lambda f: local_map(
            f,
            out_placements,
            in_placements,
            in_grad_placements,
            device_mesh,
            redistribute_inputs=redistribute_inputs,
            mesh=mesh,
            alternatives=alternatives,
        )
    name = body_name(func)
    if not callable(func):
        raise TypeError(f"local_map: func must be callable, got {type(func).__name__}")
    fixed_mesh = _mesh_of(mesh, device_mesh, name)
    options = _alternatives(name, alternatives)
    cost_hints = [None, *(o["cost_hint"] for o in options)]
    plans: dict[Mesh, list[_Placements]] = {}

    def option_plans(mesh: Mesh) -> list[_Placements]:
        if mesh not in plans:
            plans[mesh] = _option_plans(name, mesh, options, in_placements, out_placements, in_grad_placements)
        return plans[mesh]

    if fixed_mesh is not None:
        option_plans(fixed_mesh)  # validate now, before any call
    make_body = rename_inner_function(_make_body, "body", name)

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        dtensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if _is_dtensor(leaf)]
        if dtensors:
            return _torch_local_map(
                func, option_plans(fixed_mesh or Mesh.from_device_mesh(dtensors[0].device_mesh))[0], device_mesh, redistribute_inputs
            )(*args, **kwargs)
        if fixed_mesh is None:
            return func(*args, **kwargs)
        return _call_region(func, name, option_plans(fixed_mesh), cost_hints, make_body, args, kwargs)

    return call


def _option_plans(
    name: str, mesh: Mesh, options: Sequence[dict], in_placements: Any, out_placements: Any, in_grad_placements: Any
) -> list["_Placements"]:
    """The region's placements on ``mesh``: the main ones (option 0), then each alternative's,
    which must describe the same outputs."""
    main = _Placements(name, mesh, in_placements, out_placements, in_grad_placements)
    others = [
        _Placements(f"{name}, alternative {k}", mesh, o["in_placements"], o["out_placements"], o["in_grad_placements"])
        for k, o in enumerate(options, start=1)
    ]
    for k, other in enumerate(others, start=1):
        if [p is None for p in other.out_flat] != [p is None for p in main.out_flat]:
            raise LocalMapArgumentError(f"local_map({name}): alternative {k}'s out_placements describe other outputs than out_placements")
    return [main, *others]


def _call_region(
    func: Callable, name: str, all_plans: Sequence["_Placements"], cost_hints: Sequence[Any], make_body: Callable, args: tuple, kwargs: dict
) -> Any:
    """One call of a region on global tensors: its spec from the arguments, its body, the
    checks of what the placements need, the HOP call, and the outputs in ``func``'s structure."""
    plan = all_plans[0]
    leaves, args_treespec = pytree.tree_flatten((args, kwargs))
    num_arg_leaves = len(pytree.tree_leaves(args))
    tensor_positions = [position for position, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    specs = [option.spec(args, leaves, num_arg_leaves, tensor_positions) for option in all_plans]
    spec = LocalMapSpec.with_options(specs, 0, list(cost_hints))
    # Under Dynamo the body returns the caller's result itself (Dynamo's rule hands back
    # the body's structure, and a body may not record anything on the side there).
    structured = torch.compiler.is_dynamo_compiling()
    body, returned = make_body(func, leaves, tensor_positions, args_treespec, plan, structured)
    set_trace_key(body, func, args_treespec, plan, typed_values(leaf for p, leaf in enumerate(leaves) if p not in tensor_positions))
    tensors = [leaves[p] for p in tensor_positions]
    # Leaves are named by key path in the caller's arguments (args[0]['w']), and where a
    # placement does not fit, also in in_placements (in_placements[0]['w']).
    arg_names = argument_names(args, kwargs)
    names = lambda i: arg_names[tensor_positions[i]]  # noqa: E731
    entries = plan.input_entries(args, leaves[:num_arg_leaves]) + [None] * (len(leaves) - num_arg_leaves)
    _check_call(func, tensors, spec, names, lambda i: entries[tensor_positions[i]])
    if not structured:  # (under Dynamo, its rule traces the body once per alternative)
        _check_alternatives_eagerly(name, body, tensors, spec, names)
    outputs = call_body_hop(
        local_map_hop,
        body,
        tensors,
        spec,
        what=f"local_map({name})",
        input_names=names,
        user_function=func,
        device_names=names,
    )
    return outputs if structured else plan.restructure(outputs, _returned_by_equal_call(body, tensors, returned))


# What the last body run under a code key returned besides its tensors: a call whose
# inspection and plan are reused from an equal call (same code, Python state, tensor
# metadata) does not run its own body, and returns what that call's body returned.
_RETURNED: "collections.OrderedDict[tuple, _BodyReturned]" = collections.OrderedDict()
_RETURNED_SIZE = 256


def _returned_by_equal_call(body: Callable, tensors: Sequence[Any], returned: "_BodyReturned") -> "_BodyReturned":
    code_key = across_calls_key(body)
    if code_key is None or not all(isinstance(n, int) for t in tensors for n in t.shape):
        return returned  # (nothing is reused with symbolic shapes: the body ran)
    key = (code_key, tuple((tuple(t.shape), t.dtype) for t in tensors))
    if returned.ran:
        _RETURNED[key] = returned
        _RETURNED.move_to_end(key)
        while len(_RETURNED) > _RETURNED_SIZE:
            _RETURNED.popitem(last=False)
        return returned
    return _RETURNED.get(key, returned)


class _Placements:
    """A local_map's placements normalized on one mesh, and how outputs map to them."""

    def __init__(self, name: str, mesh: Mesh, in_placements: Any, out_placements: Any, in_grad_placements: Any) -> None:
        self.name, self.mesh = name, mesh
        for argument, value in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
            if value is not None and not isinstance(value, (tuple, list)):
                raise LocalMapTypeError(
                    f"local_map({name}): {argument} must have one entry per flattened input (or per positional "
                    f"argument), got {value!r}"
                )
        if in_placements is not None and in_grad_placements is not None and len(in_grad_placements) != len(in_placements):
            raise LocalMapArgumentError(
                f"local_map({name}): in_grad_placements has {len(in_grad_placements)} entries but in_placements has "
                f"{len(in_placements)}: give one per input, as in_placements does"
            )
        self.in_placements = None if in_placements is None else _normalize(tuple(in_placements), mesh, f"local_map({name}): in_placements")
        self.in_grad_placements = (
            None if in_grad_placements is None else _normalize(tuple(in_grad_placements), mesh, f"local_map({name}): in_grad_placements")
        )
        if out_placements is None:
            # torch's local_map: None is one output wrapped with no placements, i.e. replicated
            # on every mesh axis (checked to agree across devices, as every Replicate output).
            out_placements = (Replicate(),) * mesh.ndim
        if _is_placements(out_placements):
            # One output's placements given alone: [Shard(0)] or (Shard(0), Replicate()).
            self.out_tree = None
            self.out_flat: list[Any] = [placements_tuple(out_placements, mesh, f"local_map({name}): out_placements")]
            self.single = True
        else:
            normalized = _normalize(out_placements, mesh, f"local_map({name}): out_placements")
            self.single = False
            if isinstance(normalized, tuple) and all(_is_placements_leaf(p) for p in normalized):
                # torch's form: one entry per flattened output.
                self.out_tree, self.out_flat = None, list(normalized)
            else:
                # A tree mirroring the output (a dict, nested tuples).
                self.out_flat, self.out_tree = pytree.tree_flatten(normalized, is_leaf=_is_placements_leaf)
        self.tensor_outputs = tuple(p for p in self.out_flat if p is not None)
        if not self.tensor_outputs:
            raise LocalMapArgumentError(f"local_map({name}): out_placements gives placements for no tensor output")

    def inputs(self, args: tuple, leaves: list) -> list[Any]:
        return _per_leaf(self.in_placements, args, leaves, f"local_map({self.name}): in_placements")

    def spec(self, args: tuple, leaves: list, num_arg_leaves: int, tensor_positions: list[int]) -> LocalMapSpec:
        """The region's spec for a call with these flattened arguments."""
        per_leaf = self.inputs(args, leaves[:num_arg_leaves]) + [None] * (len(leaves) - num_arg_leaves)
        grads_per_leaf = self.input_grads(args, leaves[:num_arg_leaves]) + [None] * (len(leaves) - num_arg_leaves)
        for position, (leaf, placements) in enumerate(zip(leaves, per_leaf)):
            if not isinstance(leaf, torch.Tensor) and placements is not None:
                raise LocalMapTypeError(
                    f"local_map({self.name}): in_placements gives placements for {leaf_names('args', args)[position]}, "
                    f"which is a {type(leaf).__name__}, not a tensor; use None for non-tensor inputs"
                )
        replicated = tuple(Replicate() for _ in self.mesh.shape)
        return LocalMapSpec(
            self.mesh,
            tuple(per_leaf[p] or replicated for p in tensor_positions),
            self.tensor_outputs,
            self.grads_spec(tensor_positions, per_leaf, grads_per_leaf, replicated),
        )

    def input_entries(self, args: tuple, leaves: list) -> list[str | None]:
        """For each argument leaf, the in_placements entry that lays it out, by key path."""
        return _per_leaf_names(self.in_placements, args, leaves, "in_placements")

    def input_grads(self, args: tuple, leaves: list) -> list[Any]:
        return _per_leaf(self.in_grad_placements, args, leaves, f"local_map({self.name}): in_grad_placements")

    def grads_spec(self, positions: list[int], per_leaf: list, grads_per_leaf: list, replicated: tuple) -> Any:
        if self.in_grad_placements is None:
            return None
        inputs = LocalMapSpec(self.mesh, tuple(per_leaf[p] or replicated for p in positions), self.tensor_outputs)
        # Derived only where none is given (a Partial('avg') input has none to derive).
        return tuple(grads_per_leaf[p] or inputs.grad_placement(i) for i, p in enumerate(positions))

    def output_leaves(self, result: Any) -> list[Any]:
        """The body's result as the flat list out_placements describes (``None`` entries are
        non-tensor outputs), or a ``LocalMapArgumentError``."""
        if self.single:
            leaves = [result] if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)
        elif self.out_tree is not None:
            try:
                leaves = self.out_tree.flatten_up_to(result)  # dict key order does not matter
            except (ValueError, TypeError):
                leaves = None
        else:
            leaves = pytree.tree_leaves(result)
        described = "Tensor" if isinstance(result, torch.Tensor) else pytree.tree_map(
            lambda r: "Tensor" if isinstance(r, torch.Tensor) else type(r).__name__, result
        )
        if leaves is None or len(leaves) != len(self.out_flat):
            raise LocalMapArgumentError(
                f"local_map({self.name}): returned {described}, which does not match out_placements: "
                f"{len(self.out_flat)} placements for {'?' if leaves is None else len(leaves)} outputs"
            )
        for i, (leaf, placements) in enumerate(zip(leaves, self.out_flat)):
            if isinstance(leaf, torch.Tensor) and placements is None:
                raise LocalMapArgumentError(
                    f"local_map({self.name}): {self.output_name(i, result)} is a tensor but its out_placements entry is None"
                )
            if not isinstance(leaf, torch.Tensor) and placements is not None:
                raise LocalMapTypeError(
                    f"local_map({self.name}): returned {described}, which does not match out_placements: "
                    f"{self.output_name(i, result)} is a {type(leaf).__name__}, which takes None placements"
                )
        return leaves

    def output_name(self, i: int, result: Any) -> str:
        """The ``i``-th output leaf (in out_placements order) named by its key path in the
        body's result: ``output['a']``, ``output[1]``; ``output`` for a single tensor."""
        if self.single and isinstance(result, torch.Tensor):
            return "output"
        tree = result if self.out_tree is None else pytree.tree_unflatten(list(range(len(self.out_flat))), self.out_tree)
        return leaf_names("output", tree)[i]

    def structure(self, leaves: list[Any], result: Any) -> Any:
        """``leaves`` (in out_placements order) in the structure the caller gets."""
        if self.out_tree is not None:
            return pytree.tree_unflatten(leaves, self.out_tree)
        return leaves[0] if isinstance(result, torch.Tensor) else pytree.tree_unflatten(leaves, pytree.tree_structure(result))

    def restructure(self, tensor_outputs: Any, returned: "_BodyReturned") -> Any:
        """The caller's result: the region's tensors, the body's non-tensor outputs, in the
        structure the body returned (``returned``, from its last call)."""
        tensors = iter(tensor_outputs)
        leaves = [next(tensors) if p is not None else v for p, v in zip(self.out_flat, returned.constants)]
        if self.single:
            return leaves[0] if returned.treespec is None else pytree.tree_unflatten(leaves, returned.treespec)
        if self.out_tree is not None:
            return pytree.tree_unflatten(leaves, self.out_tree)
        if returned.treespec is None:  # the body returned one tensor
            return leaves[0]
        return pytree.tree_unflatten(leaves, returned.treespec)


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch.distributed absent
        return False
    return isinstance(value, DTensor)


def _torch_local_map(func: Callable, plan: _Placements, device_mesh: Any, redistribute_inputs: bool) -> Callable:
    """torch's own local_map for DTensor inputs, with this package's gradient layouts (a
    replicated input's gradient is a pending sum unless given)."""
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    def dtensor(placements: Any) -> Any:
        # A list: torch reads a tuple out_placements as one entry per output.
        return None if placements is None else [p.to_dtensor() for p in placements]

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves(args)
        per_leaf = plan.inputs(args, leaves)
        grads = plan.input_grads(args, leaves)
        derived = [
            None if p is None else LocalMapSpec(plan.mesh, (p,), plan.tensor_outputs).grad_placement(0)
            for p in per_leaf
        ]
        out = tuple(dtensor(p) for p in plan.out_flat)
        return torch_local_map(
            func,
            out_placements=out[0] if plan.single else out,
            in_placements=tuple(dtensor(p) for p in per_leaf),
            in_grad_placements=tuple(dtensor(g or d) for g, d in zip(grads, derived)),
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )(*args, **kwargs)

    return call


@dataclasses.dataclass
class _BodyReturned:
    """What a region body returned besides its tensors, from its last call: its non-tensor
    outputs (``None`` where a tensor is) and its result's structure (``None``: one tensor)."""

    constants: list[Any] = dataclasses.field(default_factory=list)
    treespec: Any = None
    ran: bool = False  # the body ran (else an equal call's inspection and plan were reused)


def _make_body(
    fn: Callable,
    leaves: list[Any],
    tensor_positions: list[int],
    args_treespec: Any,
    plan: _Placements,
    structured: bool,
) -> tuple[Callable, _BodyReturned]:
    """The region body: ``fn`` on local tensors, with non-tensor arguments baked in, and
    where it keeps what else it returned.

    It returns the flat tuple of its tensor outputs, in the order of the spec's
    out_placements, and keeps its non-tensor outputs and its result's structure in the
    ``_BodyReturned`` for the caller; or (``structured``) the result in the structure the
    caller gets, which must then hold tensors only. ``local_map`` compiles ``body`` under the
    user function's name."""
    returned = _BodyReturned()

    def body(*local_tensors: torch.Tensor) -> Any:
        local_leaves = list(leaves)
        for position, tensor in zip(tensor_positions, local_tensors):
            local_leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(local_leaves, args_treespec)
        result = fn(*args, **kwargs)
        outputs = plan.output_leaves(result)
        if structured:
            if not all(isinstance(o, torch.Tensor) for o in outputs):
                raise LocalMapTypeError(
                    f"local_map({plan.name}): under torch.compile the outputs must all be tensors; "
                    "return the non-tensor values from outside the region"
                )
            return plan.structure(outputs, result)
        returned.constants = [None if isinstance(o, torch.Tensor) else o for o in outputs]
        returned.treespec = None if isinstance(result, torch.Tensor) else pytree.tree_structure(result)
        returned.ran = True
        return tuple(o for o in outputs if isinstance(o, torch.Tensor))

    return body, returned


# --------------------------------------------------------------------------- eager


def _check_outputs(name: str | None, outputs: Sequence[Any], spec: LocalMapSpec) -> tuple[torch.Tensor, ...]:
    """The body's flat tensor outputs fit out_placements (named as the node's: ``output[j]``)."""
    where = call_prefix("local_map", name)
    if len(outputs) != len(spec.out_placements):
        raise TypeError(
            f"{where}: the body must return {len(spec.out_placements)} tensors "
            f"(one per out_placements entry), got {len(outputs)}"
        )
    for j, (output, placements) in enumerate(zip(outputs, spec.out_placements)):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{where}: output[{j}] is a {type(output).__name__}, not a tensor")
        _layout.check_rank(output.dim(), placements, spec.mesh, f"{where}: output[{j}]")
    return tuple(outputs)


class _Distribute(torch.autograd.Function):
    """A global tensor -> each device's local piece (row-major device order). The backward
    assembles the pieces' gradients into the global gradient per the gradient placements:
    a pending sum adds them, a shard concatenates them, a replicated gradient must agree.

    New-style (``setup_context``, ``jvp``, generated vmap rule), so torch.func transforms
    and forward-mode AD go through it: the tangent is distributed like the value."""

    generate_vmap_rule = True

    @staticmethod
    def forward(spec: LocalMapSpec, index: int, what: str, tensor: torch.Tensor):
        placements, mesh = spec.in_placements[index], spec.mesh
        return tuple(
            _layout.shard_for_device(tensor, placements, mesh, coordinate)
            for coordinate in _layout.device_coordinates(mesh)
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.spec, ctx.index, ctx.what, _ = inputs

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
        grad = _layout.assemble(pieces, grad_placements, mesh, f"{ctx.what}.grad")
        return None, None, None, grad

    @staticmethod
    def jvp(ctx: Any, _spec: Any, _index: Any, _what: Any, tangent: torch.Tensor):
        return _Distribute.forward(ctx.spec, ctx.index, ctx.what, tangent)


def simulate(body: Callable, tensors: Sequence[Any], spec: LocalMapSpec) -> tuple[torch.Tensor, ...]:
    """Run ``body`` once per device on its local shards and assemble the global outputs.

    Differentiable: run above autograd, the gradient of each input is assembled from its
    pieces' gradients per the spec's gradient placements."""
    name = body_name(body)
    if _compat.differentiating_over_functionalize():
        raise NotImplementedError(
            f"local_map({name}): torch.func cannot differentiate a local_map region under "
            "torch.func.functionalize (torch has no functionalize rule for the autograd Functions "
            "that assemble its gradients); functionalize inside the gradient (grad(functionalize(f))), "
            "or trace with make_fx / torch.compile, which functionalize themselves"
        )
    coordinates = _layout.device_coordinates(spec.mesh)
    per_input = []
    for i, (t, placements) in enumerate(zip(tensors, spec.in_placements)):
        if placements is None:
            per_input.append([t] * len(coordinates))
        else:
            per_input.append(_Distribute.apply(spec, i, f"local_map({name}): tensors[{i}]", t))
    pieces: list[dict[tuple[int, ...], torch.Tensor]] = [{} for _ in spec.out_placements]
    for d, coordinate in enumerate(coordinates):
        local = [pieces_of_input[d] for pieces_of_input in per_input]
        local_tensors = [t for t in local if isinstance(t, torch.Tensor)]
        versions = [version_counter(t) for t in local_tensors]
        outputs = _check_outputs(name, pytree.tree_leaves(body(*local)), spec)
        for i, (t, version) in enumerate(zip(local_tensors, versions)):
            if version_counter(t) != version:
                raise ValueError(f"local_map({name}): the body writes into its input tensors[{i}] in place; a region body must be functional")
        for j, output in enumerate(outputs):
            pieces[j][coordinate] = output
    return tuple(
        _assemble_output(p, placements, spec, f"local_map({name}): output[{j}]")
        for j, (p, placements) in enumerate(zip(pieces, spec.out_placements))
    )


def _assemble_output(pieces: dict, placements: tuple, spec: LocalMapSpec, what: str) -> torch.Tensor:
    """An output from its per-device pieces. In the whole-cotangent convention, every device
    of a replicated axis receives the whole cotangent (autograd alone would give it to the
    device whose piece is kept)."""
    if spec.replicated_cotangents and any(isinstance(p, Replicate) for p in placements):
        coordinates = list(pieces)
        values = _WholeCotangents.apply(placements, spec.mesh, what, *(pieces[c] for c in coordinates))
        pieces = dict(zip(coordinates, values))
    return _layout.assemble(pieces, placements, spec.mesh, what)


class _WholeCotangents(torch.autograd.Function):
    """Pieces of an output as they are; in the backward, each piece replicated along an axis
    gets the cotangent its whole replicated group receives (the identity on values, and on
    tangents)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(placements: tuple, mesh: Mesh, what: str, *pieces: torch.Tensor):
        return tuple(p.clone() for p in pieces)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.placements, ctx.mesh = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        coordinates = _layout.device_coordinates(ctx.mesh)
        by_coordinate = dict(zip(coordinates, grads))
        spread = []
        for coordinate in coordinates:
            # The cotangent reaching this group: what its first device along each replicated axis got.
            source = tuple(0 if isinstance(p, Replicate) else c for p, c in zip(ctx.placements, coordinate))
            grad = by_coordinate[source]
            spread.append(None if grad is None else grad.clone())
        return (None, None, None, *spread)

    @staticmethod
    def jvp(ctx: Any, _placements: Any, _mesh: Any, _what: Any, *tangents: Any):
        return tuple(t.clone() for t in tangents)


@local_map_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *tensors_and_spec: Any):
    return local_map_hop.eager_rule(body, *tensors_and_spec)


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


# --------------------------------------------------------------------------- inductor


@_inductor.register_inductor_rule(local_map_hop)
def _inductor_rule(body: Callable, *operands_and_spec: Any) -> tuple:
    """The per-device program on one device: each device's shards sliced out, the body once
    per device, the outputs reassembled (the eager semantics, traced). A region with
    alternatives holds one body per alternative: the active one runs."""
    operands, spec = local_map_hop.split_args(operands_and_spec)
    if isinstance(body, (tuple, list)):
        body = body[local_map_hop.active_option(spec)]
    return local_map_hop.run_at_boundary(_inductor.inlined(body), operands, spec)
