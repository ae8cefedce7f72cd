"""Sharding strategies from DTensor's own propagation rules, the registry DTensor dispatch uses.

Every torch internal the solver borrows from ``torch.distributed.tensor`` is here, with why:

- ``DTensor._op_dispatcher.sharding_propagator``: the rule tables DTensor dispatch reads.
  torch 2.9 keeps one strategy function per op (``op_strategy_funcs``); 2.13 adds rules written
  for one mesh axis (``op_single_dim_strategy_funcs``), which DTensor expands over every mesh
  axis with ``_expand_single_dim_strategy_to_mesh``; by 2.15 most ops moved there.
- ``OpSchema`` / ``OpStrategy`` / ``OpSpec`` / ``DTensorSpec`` / ``TensorMeta``: the rules'
  argument and result types.
- ``gen_einsum_strategies``: the rule DTensor's matmul ops are built from, applied to an
  einsum kernel's equation.
- ``torch.distributed.tensor._ops.utils.redistribute_cost``: what every rule prices each of
  its strategies with against each placement an input may have (``generate_redistribute_costs``).
  The solver prices redistributions itself and reads only the strategies' placements, so while
  it enumerates them (``free_redistribute_costs``) the function returns 0: those rows are
  candidates x strategies per input, most of the work on a 3-D mesh (hundreds of each).

A rule needs a ``DeviceMesh``, which needs a process group: ``fake_device_mesh`` makes a
fake one (no communication) when none is initialized, and tears it down afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from hops.specs import Mesh, Partial, Replicate, Shard

Placements = tuple  # one hops placement per mesh axis

# Above this many combinations of input candidates, a rule that needs one strategy per input
# is called per candidate of each input instead.
_MAX_COMBINATIONS = 256


def _is_arg(value: Any) -> bool:
    return isinstance(value, TensorArg)


@contextlib.contextmanager
def fake_device_mesh(mesh: Mesh) -> Iterator[Any]:
    """A DTensor ``DeviceMesh`` for ``mesh``; starts a fake process group if none is running."""
    import torch.distributed as dist

    started = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(mesh.device_ids) + 1)
        started = True
    try:
        yield mesh.to_device_mesh()
    finally:
        if started:
            dist.destroy_process_group()


@contextlib.contextmanager
def free_redistribute_costs() -> Iterator[None]:
    """DTensor's rules skip pricing their strategies (see the module docstring) until exit."""
    from torch.distributed.tensor._ops import utils

    original = utils.redistribute_cost
    utils.redistribute_cost = _no_cost
    try:
        yield
    finally:
        utils.redistribute_cost = original


def _no_cost(current_spec: Any, target_spec: Any) -> float:
    return 0.0


def to_dtensor(placements: Placements) -> tuple:
    return tuple(p.to_dtensor() for p in placements)


def from_dtensor(placements: Sequence[Any], ndim: int) -> Placements | None:
    """hops placements for a tensor of rank ``ndim`` (DTensor rules may count dims from the
    end), or ``None`` for what the solver does not use (``Partial`` other than a sum, strided
    shards, a dim out of range)."""
    from torch.distributed.tensor import placement_types as pt

    out = []
    for p in placements:
        if type(p) is pt.Shard:
            if not -ndim <= p.dim < ndim:
                return None
            out.append(Shard(p.dim % ndim))
        elif type(p) is pt.Replicate:
            out.append(Replicate())
        elif type(p) is pt.Partial and p.reduce_op == "sum":
            out.append(Partial())
        else:
            return None
    return tuple(out)


def rule_of(op: Any) -> Any:
    """The op whose DTensor rule places ``op``: ``op`` itself, or for a functional op without
    one its in-place variant's (functionalization turns DTensor's ``fill_`` into the ``fill``
    it has no rule for; both lay out their result alike). ``None``: DTensor's sharding
    propagator has no strategy for it, so the solver prices it replicated and
    ``passes.lower_to_dtensor`` runs it so (inputs gathered, the op on local tensors)."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    single_dim = getattr(propagator, "op_single_dim_strategy_funcs", {})
    if op in single_dim or op in propagator.op_strategy_funcs:
        return op
    packet = getattr(torch.ops.aten, f"{op.overloadpacket.__name__}_", None) if op.namespace == "aten" else None
    inplace = getattr(packet, op._overloadname, None) if packet is not None else None
    if inplace is not None and (inplace in single_dim or inplace in propagator.op_strategy_funcs):
        return inplace
    return None


class StrategyRules:
    """Enumerate an ATen op's strategies with DTensor's rule for it, on one device mesh."""

    def __init__(self, mesh: Mesh, device_mesh: Any) -> None:
        from torch.distributed.tensor import DTensor

        self.mesh = mesh
        self.device_mesh = device_mesh
        self.propagator = DTensor._op_dispatcher.sharding_propagator
        self._single_dim = getattr(self.propagator, "op_single_dim_strategy_funcs", {})

    def rule_of(self, op: Any) -> Any:
        return rule_of(op)

    def has_rule(self, op: Any) -> bool:
        return self.rule_of(op) is not None

    def is_single_dim(self, op: Any) -> bool:
        """Whether ``op``'s rule is written for one mesh axis (expanded over the mesh)."""
        return self.rule_of(op) in self._single_dim

    def _spec(self, meta: Any, placements: Placements) -> Any:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        return DTensorSpec(self.device_mesh, to_dtensor(placements), tensor_meta=meta)

    def _schema(self, op: Any, args: Any, kwargs: Any, candidates: Any, single: bool) -> Any:
        """``args``/``kwargs`` with each tensor replaced by an ``OpStrategy`` of its candidate
        placements (``single``: one representative placement, as single-axis rules expect)."""
        from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

        def to_strategy(value: Any) -> Any:
            if not isinstance(value, TensorArg):
                return value
            options = candidates(value)
            if single:
                options = [_representative(value.meta, self.mesh)]
            return OpStrategy([OpSpec(self._spec(value.meta, p)) for p in options])

        def convert(value: Any) -> Any:
            # A list of tensors is a TupleStrategy, as DTensor dispatch wraps it.
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, TensorArg) for v in value):
                return TupleStrategy(tuple(to_strategy(v) for v in value))
            if isinstance(value, (list, tuple)):
                return type(value)(to_strategy(v) for v in value)
            return to_strategy(value)

        source = self.rule_of(op)
        schema_info = self.propagator.op_to_schema_info.get(source)
        if schema_info is None and single:
            schema_info = getattr(self.propagator, "op_to_schema_info_for_single_dim_strategy", {}).get(source)
        return OpSchema(
            op,
            tuple(convert(a) for a in args),
            {k: convert(v) for k, v in kwargs.items()},
            schema_info=schema_info,
        )

    def op_strategies(self, op: Any, args: Any, kwargs: Any, candidates: Any, out_meta: Any) -> list[Any]:
        """DTensor's strategies for ``op``: a list of ``OpSpec`` (``output_specs``,
        ``input_specs`` in the order of the tensor arguments).

        A rule written for one mesh axis is expanded over the mesh as DTensor does. A rule
        for the whole mesh is called with every candidate placement of every input at once;
        some rules handle only inputs with one strategy each (they raise, or pair up the
        inputs' strategies), and are then called once per combination of candidates (per
        candidate of each input, the others replicated, when there are too many).
        """
        source = self.rule_of(op)
        if source in self._single_dim:
            from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh

            schema = self._schema(op, args, kwargs, candidates, single=True)
            expand = _expand_single_dim_strategy_to_mesh(self.device_mesh, schema, self._single_dim[source], out_meta)
            return list(expand(op, schema.args_meta, schema.kwargs_meta).strategies)
        rule = self.propagator.op_strategy_funcs[source]
        try:
            return list(rule(self._schema(op, args, kwargs, candidates, single=False)).strategies)
        except Exception as error:
            first_error = error
        tensors = [a for a in pytree.tree_leaves((args, kwargs), is_leaf=_is_arg) if isinstance(a, TensorArg)]
        options = [list(candidates(t)) for t in tensors]
        if math.prod(len(o) for o in options) <= _MAX_COMBINATIONS:
            combinations = itertools.product(*options)
        else:
            replicated = tuple(Replicate() for _ in self.mesh.shape)
            combinations = (
                tuple(p if j == i else replicated for j in range(len(tensors)))
                for i, o in enumerate(options)
                for p in o
            )
        found: list[Any] = []
        for combination in combinations:
            chosen = dict(zip(map(id, tensors), combination))
            schema = self._schema(op, args, kwargs, lambda t, chosen=chosen: [chosen[id(t)]], single=False)
            try:
                found += rule(schema).strategies
            except Exception:  # this combination is not one the rule can place
                continue
        if not found:
            raise first_error
        return found

    def einsum_strategies(self, equation: str) -> list[Any]:
        from torch.distributed.tensor._ops._einsum_strategy import gen_einsum_strategies

        return list(gen_einsum_strategies(equation, self.device_mesh).strategies)


class TensorArg:
    """A tensor argument of a node while its strategies are enumerated: its metadata and
    the graph value it reads."""

    __slots__ = ("meta", "value")

    def __init__(self, meta: Any, value: Any) -> None:
        self.meta = meta
        self.value = value


def tensor_meta(shape: Sequence[int], dtype: torch.dtype) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    shape = torch.Size(shape)
    return TensorMeta(shape, _contiguous_strides(shape), dtype)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _representative(meta: Any, mesh: Mesh) -> Placements:
    """A placement that tells a single-axis rule that sharded inputs exist (its placeholders
    become ``Shard``); the rule's strategies do not depend on it otherwise."""
    if len(meta.shape) == 0:
        return tuple(Replicate() for _ in mesh.shape)
    return (Shard(0),) + tuple(Replicate() for _ in mesh.shape[1:])


def all_placements(shape: Sequence[int], mesh: Mesh, *, partial: bool = False) -> list[Placements]:
    """Every layout of a tensor of ``shape`` on ``mesh`` that splits evenly: per mesh axis
    ``Shard(d)`` or ``Replicate()`` (and ``Partial()`` if ``partial``)."""
    per_axis = [Replicate()] + [Shard(d) for d in range(len(shape))] + ([Partial()] if partial else [])
    return [p for p in itertools.product(per_axis, repeat=mesh.ndim) if splits_evenly(p, shape, mesh)]


def splits_evenly(placements: Placements, shape: Sequence[int], mesh: Mesh) -> bool:
    """Whether every dim of ``shape`` divides by the mesh axes sharding it (and each is > 1)."""
    factor = [1] * len(shape)
    for size, p in zip(mesh.shape, placements):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return False
            factor[p.dim] *= size
    return all(f == 1 or (n % f == 0 and n >= f) for n, f in zip(shape, factor))
