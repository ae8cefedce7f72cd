"""``placement_graph``: a networkx view of a traced program for a sharding solver.

One node per tensor value of the program, values inside HOP bodies included under
scope-qualified names (``layer_body_0/mm``). Besides values, two kinds of nodes carry a
choice that several values share: an op with several tensor outputs (its outputs are
``getitem`` values that *alias* it) and a ``local_map`` region (its strategies are its
placement alternatives).

Node attributes:

- ``kind``: a ``NodeKind``: ``INPUT`` (a program or body input whose placement is free), ``OP`` (an
  ATen op or kernel), ``ANNOTATION`` (fixed by a ``hops_sharding_annotation``), ``REGION`` (a
  ``local_map`` node), ``ALIAS`` (a value whose placement is another node's: a ``getitem``, a body
  input tied to what feeds it, a scan's outputs), ``LOCAL`` (a value inside a region body: per
  device, not placed), ``OUTPUT`` (a graph's results, which read what leaves it);
- ``op`` (the target, as text), ``shape``, ``dtype``, ``bytes``;
- ``strategies``: the node's choices, each a ``Strategy`` (the placement of every output and the
  placement every tensor input must have); ``None`` for aliases and local values;
- ``fixed``: the choices are stated by a HOP's typed args (an annotation, a region);
- ``alias``: ``(node, output_index, dim_shift)``: this value is output ``output_index`` of
  ``node``'s placement with every ``Shard(d)`` moved to ``Shard(d + dim_shift)`` (a scan's stacked
  ys are their step's value with a leading dim);
- ``whole``: this alias is the value as it left its graph (a saved forward value the backward
  reads, a scan's final carry): a graph's outputs are reduced before they leave it, so its
  placement is the aliased one with each ``Partial`` made ``Replicate`` (``arrives_whole``), and
  it is read without a second reduction;
- ``multiplier``: how many times the value is computed per program run (a scan body's values:
  the trip count);
- ``fallback``: DTensor has no rule for the op (or its rule refuses every layout the op's inputs
  can have), so it runs replicated; the graph's ``unsupported_ops`` counts them per op and
  ``rule_errors`` keeps why a rule refused;
- ``role``: what the value keeps resident on each device, for memory budgets:
  ``"parameter"`` (an input with a gradient: the gradient and optimizer state come with it),
  ``"input"``, ``"activation"`` (saved by the forward for the backward), else ``None``;
- ``scope``: the scope-qualified name of the graph holding the value (``""`` for the root);
- ``body_values`` (a region): per alternative, the keys of its body's values (``LOCAL`` nodes,
  those of HOP bodies inside it included), which its compute is priced on;
- ``fx_node``, ``module``: the FX node and the GraphModule holding it.

Edges ``u -> v`` are data dependencies, with ``bytes`` (of ``u``) and ``uses``: how ``v`` reads
``u``, each a ``Use`` whose ``kind`` is a ``UseKind``: ``(INPUT, slot)`` (``v`` is a node with
strategies; its chosen strategy says which placement ``u`` must have) or ``(VALUE, dim_shift)``
(``u`` must be laid out like ``v``, e.g. a scan's init like its carry, a gradient like its
parameter: how the gradient leaves the backward, in place of its output's reduction) or
``(OUTPUT, 0)`` (``v`` is the ``OUTPUT`` node of a program or a scan body: ``u`` leaves it whole,
so a pending ``Partial`` sum is reduced first; a scan body's ys are not read so) or ``(CARRY, 0)`` (``v`` is a scan's
carry input, ``u`` its carry output of the step before, as it left that step: whole), with the
``multiplier`` of that read. Edges that only tie placements (``getitem``, a forward value the
backward reads) have no uses and ``tie=True``.

A scan body appears once, and every value in it has the scan's trip count as multiplier. Its
carry inputs are free: the init is redistributed to one once, before the loop, and each later
step's carry input is the step before's carry output (edge ``loop=True``) redistributed to it
(trip count - 1 times, a no-op when they are laid out alike); the final carry is the last
step's carry output, as it left the step (whole). Its slices are free inputs fed by the stacked
xs, which are redistributed once, before the loop (a slice is laid out as its stacked value
without the leading dim). The stacked ys alias the body's ys with a leading dim: a y may leave
its step with a pending ``Partial`` sum (stacking keeps it, as a loop accumulating per-layer
gradients keeps it), and the stacked ys are reduced once, after the loop, where they are read
in another layout. Nothing is read from ``node.meta`` except the ``val`` every tracer records
(recomputed from ``example_inputs`` when missing).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from collections import Counter
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.named_scope import named_scope_hop
from hops.scan import ScanSpec, scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, Mesh, Partial, Replicate, Shard, ShardingSpec
from passes._infra import PassError, hop_row, hop_table, is_package_hop, ordinary_op
from passes.solver import _dtensor
from passes.solver._shapes import split_backward_inputs, value_metadata

__all__ = [
    "placement_graph", "NodeKind", "Strategy", "Use", "UseKind", "RegionChoice", "region_choices", "shift_placements", "format_placement",
    "arrives_whole", "Plan", "read_as", "required_placement",
]

Placements = tuple  # one hops placement per mesh axis


class _Kind(enum.Enum):
    """A kind of the placement graph's records, compared by identity (``kind is NodeKind.REGION``).
    Comparing one with a string is a ``TypeError``: code written against text kinds fails where
    it compares, not by finding no record of the kind it names."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            name = type(self).__name__
            raise TypeError(f"a placement graph kind is a {name}: compare it with {name} members, not {other!r}")
        return self is other

    def __hash__(self) -> int:
        return hash(self._name_)

    def __str__(self) -> str:  # printed as the text it is named by in the module docstring
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class NodeKind(_Kind):
    """What a node of the placement graph is: its ``kind`` attribute (see the module docstring)."""

    INPUT = "input"
    OP = "op"
    ANNOTATION = "annotation"
    REGION = "region"
    ALIAS = "alias"
    LOCAL = "local"
    OUTPUT = "output"


class UseKind(_Kind):
    """How a node reads a value: a ``Use``'s ``kind`` (see the module docstring)."""

    INPUT = "input"  # an input slot of the reader's strategy
    VALUE = "value"  # laid out like the reader (with ``index`` more dims in front)
    OUTPUT = "output"  # leaving its graph: whole
    CARRY = "carry"  # a scan's carry input reading the step before's carry output, as it left that step


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to compute a node: ``outputs[i]`` is the placement of its i-th output (``None``
    for a non-tensor output), ``inputs[k]`` the placement its k-th tensor input must have."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements | None, ...]
    cost_hint: float | None = None  # seconds per call, given by the program (a region alternative)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple(canonical(p) for p in self.outputs))
        object.__setattr__(self, "inputs", tuple(canonical(p) for p in self.inputs))

    def __repr__(self) -> str:
        ins = ", ".join(format_placement(p) for p in self.inputs)
        outs = ", ".join(format_placement(p) for p in self.outputs)
        return f"({ins}) -> {outs}"


class Use(NamedTuple):
    """How a node reads a value (see the module docstring). ``reader`` is the FX node whose
    argument it is (the op, the scan, the backward's output) and ``position`` the index of that
    argument among the leaves of ``(reader.args, reader.kwargs)``."""

    kind: UseKind
    index: int  # the input slot ("input"), or a dim shift ("value")
    multiplier: int
    reader: Any = None
    position: int = -1
    shape: tuple | None = None  # the bytes moved are of this shape, not the value's (one slice of it)


class RegionChoice(NamedTuple):
    """One placement option of a ``local_map`` region."""

    in_placements: tuple
    out_placements: tuple
    in_grad_placements: tuple | None
    cost_hint: float | None


def region_choices(spec: LocalMapSpec) -> list[RegionChoice]:
    """A region's placement options: its ``alternatives`` when the spec has them, else its one set."""
    if spec.alternatives:
        return [RegionChoice(a.in_placements, a.out_placements, a.in_grad_placements, a.cost_hint) for a in spec.alternatives]
    return [RegionChoice(spec.in_placements, spec.out_placements, spec.in_grad_placements, None)]


def format_placement(placements: Placements | None) -> str:
    """``S(0)R``: one short token per mesh axis; ``-`` for a non-tensor."""
    if placements is None:
        return "-"
    tokens = []
    for p in placements:
        if isinstance(p, Shard):
            tokens.append(f"S({p.dim})")
        elif isinstance(p, Replicate):
            tokens.append("R")
        elif isinstance(p, Partial):
            tokens.append("P" if p.reduce_op == "sum" else f"P({p.reduce_op})")
        else:
            tokens.append(repr(p))
    return "".join(tokens)


# One object per distinct placements tuple: the solver keys its tables by identity, which is
# much cheaper than hashing placement values (tens of thousands of lookups per solve).
_CANONICAL: dict[tuple, tuple] = {}
_SHIFTED: dict[tuple[int, int], tuple] = {}
_MATERIALIZED: dict[int, tuple] = {}


def canonical(placements: Placements | None) -> Placements | None:
    """The one shared object equal to ``placements``."""
    if placements is None:
        return None
    return _CANONICAL.setdefault(placements, placements)


def materialized(placements: Placements | None) -> Placements | None:
    """``placements`` with each pending ``Partial`` sum reduced (made ``Replicate``)."""
    if placements is None:
        return None
    key = id(canonical(placements))
    if key not in _MATERIALIZED:
        _MATERIALIZED[key] = canonical(tuple(Replicate() if isinstance(p, Partial) else p for p in placements))
    return _MATERIALIZED[key]


def shift_placements(placements: Placements | None, shift: int) -> Placements | None:
    """``placements`` with every ``Shard(d)`` made ``Shard(d + shift)``."""
    if placements is None or shift == 0:
        return placements
    key = (id(canonical(placements)), shift)
    if key not in _SHIFTED:
        _SHIFTED[key] = canonical(tuple(Shard(p.dim + shift) if isinstance(p, Shard) else p for p in placements))
    return _SHIFTED[key]


def arrives_whole(graph: nx.DiGraph, key: str) -> bool:
    """``key`` is a value as it left its graph (a saved forward value the backward reads, a scan's
    final carry), or aliases one: a pending ``Partial`` sum of what it aliases was reduced on the
    way, so its placement is that one ``materialized``."""
    while key is not None:
        data = graph.nodes[key]
        if data.get("whole"):
            return True
        key = data["alias"][0] if data["alias"] is not None else None
    return False


class Plan(Protocol):
    """What a solved plan says of the graph's nodes (``PlacementSolution`` is one): the chosen
    ``Strategy`` of every node with strategies, the placement of every tensor value."""

    strategies: Mapping[str, Strategy]
    placements: Mapping[str, Placements]


def read_as(use: Use, produced: Placements | None) -> Placements | None:
    """The layout ``use`` reads a value placed as ``produced`` in: a carry as it left its step (whole)."""
    return materialized(produced) if use.kind is UseKind.CARRY else produced


def required_placement(plan: Plan, key: str, use: Use, produced: Placements | None) -> Placements | None:
    """The placement ``use`` (a read by node ``key``) needs, under ``plan``, of a value placed as
    ``produced``: the input slot's of ``key``'s strategy, the value whole as it leaves its graph,
    or ``key``'s own placement (with ``use.index`` more dims in front)."""
    if use.kind is UseKind.INPUT:
        return plan.strategies[key].inputs[use.index]
    if use.kind is UseKind.OUTPUT:
        return materialized(produced)
    return shift_placements(plan.placements[key], use.index)


def _replicated(mesh: Mesh) -> Placements:
    return tuple(Replicate() for _ in mesh.shape)


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else f"{target.namespace}.{target.__name__}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", None) or getattr(target, "_name", None) or str(target)


# Ops that only relabel memory: the solver gives them no compute cost.
VIEW_OPS = frozenset(
    name
    for name in (
        "view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "select", "slice",
        "unsqueeze", "squeeze", "detach", "alias", "as_strided", "unbind", "split", "split_with_sizes",
        "view_as_real", "view_as_complex", "flatten", "unflatten", "_reshape_alias", "lift_fresh_copy",
    )
)


def is_view(target: Any) -> bool:
    """A view op, or its functional ``*_copy`` form (``view_copy``, ``transpose_copy``: what
    functionalization writes for the same view, e.g. in a region body traced inside a scan; a
    compiler lowers both alike, so both are free here)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target.overloadpacket.__name__
    return name in VIEW_OPS or (name.endswith("_copy") and name[: -len("_copy")] in VIEW_OPS)


class _Builder:
    def __init__(self, mesh: Mesh, values: dict, rules: _dtensor.StrategyRules) -> None:
        self.mesh = mesh
        self.values = values  # fx.Node -> fake tensor / tuple / python value
        self.rules = rules
        self.graph = nx.DiGraph(mesh=mesh)
        self.key: dict[fx.Node, str] = {}
        self.added: list[str] = []  # every key, in the order added
        self.unsupported: Counter = Counter()
        self._strategy_cache: dict[Any, tuple] = {}
        self._hop_getitems: set[fx.Node] = set()
        self.rule_errors: dict[str, str] = {}  # op -> why DTensor's rule refused it (the first time)

    # ------------------------------------------------------------------ values

    def _meta(self, node: fx.Node) -> Any:
        return self.values.get(node)

    def _is_tensor(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and isinstance(self.values.get(node), torch.Tensor)

    def _add(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int, **attrs: Any) -> str:
        key = f"{scope}{node.name}"
        meta = self._meta(node)
        if isinstance(meta, torch.Tensor):
            shape, dtype = tuple(int(s) for s in meta.shape), meta.dtype
            nbytes = math.prod(shape) * meta.element_size()
        else:
            shape = dtype = None
            nbytes = 0
        defaults = dict(
            kind=NodeKind.OP, op=_target_name(node.target) if node.op == "call_function" else node.op, shape=shape,
            dtype=dtype, bytes=nbytes, strategies=None, fixed=False, alias=None, multiplier=multiplier,
            fallback=False, role=None, fx_node=node, module=module, scope=scope.rstrip("/"), whole=False,
        )
        defaults.update(attrs)
        self.graph.add_node(key, **defaults)
        self.key[node] = key
        self.added.append(key)
        return key

    def _use(self, value: Any, key: str, use: Use) -> None:
        """``key`` reads ``value`` as ``use``."""
        source = self.key[value] if isinstance(value, fx.Node) else value
        if self.graph.has_edge(source, key):
            self.graph.edges[source, key]["uses"].append(use)
        else:
            self.graph.add_edge(source, key, bytes=self.graph.nodes[source]["bytes"], uses=[use], tie=False)

    def drop_output_use(self, source: str, output: str, position: int) -> None:
        """``output`` no longer reads ``source`` at leaf ``position`` as an ``OUTPUT`` use."""
        if not self.graph.has_edge(source, output):
            return
        uses = self.graph.edges[source, output]["uses"]
        uses[:] = [u for u in uses if not (u.kind is UseKind.OUTPUT and u.position == position)]
        if not uses:
            self.graph.remove_edge(source, output)

    def _tie(self, source: str, key: str, **attrs: Any) -> None:
        if not self.graph.has_edge(source, key):
            self.graph.add_edge(source, key, bytes=self.graph.nodes[source]["bytes"], uses=[], tie=True, **attrs)

    def _set_alias(self, key: str, target: str, index: int = 0, shift: int = 0, whole: bool = False) -> None:
        data = self.graph.nodes[key]
        data.update(kind=NodeKind.ALIAS, alias=(target, index, shift), strategies=None, whole=whole)
        self._tie(target, key)

    def resolve(self, key: str) -> tuple[str, int, int]:
        """The node whose strategy decides ``key``'s placement: ``(owner, output_index, shift)``."""
        index, shift = 0, 0
        seen = set()
        while True:
            alias = self.graph.nodes[key]["alias"]
            if alias is None:
                return key, index, shift
            if key in seen:
                raise PassError(f"placement_graph: values {sorted(seen)} only alias each other")
            seen.add(key)
            target, target_index, target_shift = alias
            key, index, shift = target, target_index, shift + target_shift
            if self.graph.nodes[key]["alias"] is not None and target_index != 0:
                raise PassError(f"placement_graph: {key} is aliased at output {target_index} but has one output")

    def candidates(self, key: str) -> list[Placements]:
        """The placements ``key`` can have (each strategy of its owner, projected)."""
        owner, index, shift = self.resolve(key)
        strategies = self.graph.nodes[owner]["strategies"]
        project = materialized if arrives_whole(self.graph, key) else canonical
        seen = dict.fromkeys(project(shift_placements(s.outputs[index], shift)) for s in strategies)
        return [p for p in seen if p is not None]

    def free_input(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int, kind: NodeKind = NodeKind.INPUT) -> str:
        key = self._add(node, scope, module, multiplier, kind=kind, op=node.op)
        data = self.graph.nodes[key]
        if data["shape"] is not None:
            data["strategies"] = [Strategy((p,), ()) for p in _dtensor.all_placements(data["shape"], self.mesh)]
        return key

    # ------------------------------------------------------------------ graphs

    def walk(
        self,
        module: fx.GraphModule,
        scope: str,
        multiplier: int,
        inputs: dict[fx.Node, Any] | None = None,
        local: bool = False,
        materialize: bool | int = True,
    ) -> list[Any]:
        """Add ``module``'s values; ``inputs`` maps a placeholder to how it is bound (see
        ``_bind``). With ``materialize``, its outputs leave it as whole values (a program's
        results, a loop step's carries: no pending ``Partial`` sum); an int: only that many
        leading outputs (a scan step's ys may leave with their pending sums, which stacking keeps
        and one reduction after the loop settles). Returns the output node's args (fx nodes of
        ``module``)."""
        inputs = inputs or {}
        outputs: list[Any] = []
        for node in module.graph.nodes:
            if node.op == "placeholder":
                if local:
                    self._add(node, scope, module, multiplier, kind=NodeKind.LOCAL, op="placeholder")
                elif node in inputs:
                    self._bind(node, scope, module, multiplier, inputs[node])
                elif self._is_tensor(node):
                    self.free_input(node, scope, module, multiplier)
            elif node.op == "get_attr":
                if self._is_tensor(node):
                    if local:
                        self._add(node, scope, module, multiplier, kind=NodeKind.LOCAL, op="get_attr")
                    else:
                        self.free_input(node, scope, module, multiplier)
            elif node.op == "call_function":
                if local:
                    self._local_node(node, scope, module, multiplier)
                else:
                    self._call(node, scope, module, multiplier)
            elif node.op == "output":
                result = node.args[0]
                outputs = list(result) if isinstance(result, (tuple, list)) else [result]
                if materialize is not False and not local:
                    whole = None if materialize is True else materialize
                    self._output(node, scope, module, multiplier, whole)
        return outputs

    def _output(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int, whole: int | None) -> None:
        """The graph's output node, reading its first ``whole`` outputs whole (``None``: all)."""
        key = self._add(node, scope, module, multiplier, kind=NodeKind.OUTPUT, op="output")
        for position, value in enumerate(pytree.tree_leaves((node.args, node.kwargs))[:whole]):
            if self._is_tensor(value) and self.key.get(value) is not None:
                self._use(value, key, Use(UseKind.OUTPUT, 0, multiplier, node, position))

    def _bind(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int, binding: Any) -> None:
        kind, value = binding
        if kind in ("alias", "saved"):  # the placeholder is ``value`` (named scope inputs; saved forward values, whole)
            key = self._add(node, scope, module, multiplier, op="placeholder")
            self._set_alias(key, self.key[value], whole=kind == "saved")
        elif kind == "feed":  # a free input fed by operand ``position`` of ``reader`` (shifted)
            outer, shift, outer_multiplier, reader, position = value
            key = self.free_input(node, scope, module, multiplier)
            # Once, before the loop: the init to the carry's layout, the stacked xs to their
            # slices' (with a leading dim), an additional input to the body's.
            self._use(outer, key, Use(UseKind.VALUE, shift, outer_multiplier, reader, position))
        else:
            raise AssertionError(kind)

    def _local_node(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        if not (self._is_tensor(node) or isinstance(self._meta(node), (tuple, list))):
            return
        key = self._add(node, scope, module, multiplier, kind=NodeKind.LOCAL)
        for value in node.all_input_nodes:
            if value in self.key and self.graph.nodes[self.key[value]]["kind"] is NodeKind.LOCAL:
                self._tie(self.key[value], key)
        for attr, body in _bodies(node):
            self.walk(body, f"{scope}{attr.target}/", multiplier, local=True)

    def _call(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        target = node.target
        if node in self._hop_getitems:
            return  # made by the HOP's rule
        if target is operator.getitem and self.key.get(node.args[0]) is not None:
            source = self.key[node.args[0]]
            if self._is_tensor(node):
                key = self._add(node, scope, module, multiplier, op="getitem")
                self._set_alias(key, source, node.args[1])
            return
        if is_package_hop(target):
            view = hop_row(SOLVER_VIEW, target, "placement_graph", node)
            if view is not ordinary_op:
                view(self, node, scope, module, multiplier)
                return
        if self._is_tensor(node) or self._tensor_tuple(node):
            self._op(node, scope, module, multiplier)

    def _tensor_tuple(self, node: fx.Node) -> bool:
        meta = self._meta(node)
        return isinstance(meta, (tuple, list)) and any(isinstance(m, torch.Tensor) for m in meta)

    def _tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if self._is_tensor(a)]

    def _read_inputs(self, node: fx.Node, key: str, multiplier: int) -> None:
        """``key`` reads each tensor argument of ``node``: slot k is its k-th tensor leaf."""
        slot = 0
        for position, value in enumerate(pytree.tree_leaves((node.args, node.kwargs))):
            if self._is_tensor(value):
                self._use(value, key, Use(UseKind.INPUT, slot, multiplier, node, position))
                slot += 1

    # ------------------------------------------------------------------ HOPs

    def _annotation(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        spec = node.args[1]
        if not isinstance(spec, ShardingSpec):
            raise PassError(f"placement_graph: {node.format_node()}: spec must be a hops.ShardingSpec")
        self._check_mesh(spec.mesh, node)
        key = self._add(node, scope, module, multiplier, kind=NodeKind.ANNOTATION, fixed=True)
        self.graph.nodes[key]["strategies"] = [Strategy((spec.placements,), (spec.placements,))]
        self._read_inputs(node, key, multiplier)

    def _check_mesh(self, mesh: Mesh, node: fx.Node) -> None:
        if mesh != self.mesh:
            raise PassError(
                f"placement_graph: {node.format_node()} is placed on {mesh!r}, but the program is "
                f"being placed on {self.mesh!r}; one mesh per program"
            )

    def _region(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        spec = node.args[-1]
        if not isinstance(spec, LocalMapSpec):
            raise PassError(f"placement_graph: {node.format_node()}: last argument must be a hops.LocalMapSpec")
        self._check_mesh(spec.mesh, node)
        operands = list(node.args[1:-1])
        tensor_slots = [i for i, v in enumerate(operands) if self._is_tensor(v)]
        strategies = []
        for choice in region_choices(spec):
            strategies.append(
                Strategy(
                    tuple(choice.out_placements),
                    tuple(choice.in_placements[i] for i in tensor_slots),
                    choice.cost_hint,
                )
            )
        bodies = _bodies(node)
        if len(bodies) != len(strategies):
            raise PassError(
                f"placement_graph: {node.format_node()} has {len(bodies)} bodies for {len(strategies)} alternatives"
            )
        # Each alternative's body, on its own local shapes, under its own scope: the cost
        # model prices strategy k with body k.
        body_scopes = [f"{scope}{attr.target}" for attr, _ in bodies]
        key = self._add(
            node, scope, module, multiplier, kind=NodeKind.REGION, fixed=True, strategies=strategies,
            body_scope=body_scopes[spec.active or 0], body_scopes=body_scopes, residuals=spec.residuals,
            output_shapes=[tuple(int(s) for s in m.shape) for m in self._meta(node)],
        )
        self._read_inputs(node, key, multiplier)
        body_values = []
        for body_scope, (_, body) in zip(body_scopes, bodies):
            start = len(self.added)
            self.walk(body, f"{body_scope}/", multiplier, local=True)
            body_values.append(tuple(dict.fromkeys(self.added[start:])))
        self.graph.nodes[key]["body_values"] = body_values

    def _named_scope(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        body = _body(node)
        operands = list(node.args[1:-1])
        placeholders = body.graph.find_nodes(op="placeholder")
        inputs = {p: ("alias", v) for p, v in zip(placeholders, operands) if self._is_tensor(v)}
        body_outputs = self.walk(body, f"{scope}{node.args[0].target}/", multiplier, inputs, materialize=False)
        self._hop_outputs(node, scope, module, multiplier, body_outputs, shift=0)

    def _hop_outputs(
        self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int, body_outputs: list, shift: int | list,
        whole: list[bool] | None = None,
    ) -> None:
        """The HOP's tuple output as an alias node of nothing; its getitems alias body outputs
        (``whole[i]``: output ``i`` as it left the body, pending sums reduced)."""
        self.key[node] = None  # getitems are resolved below, not through the tuple
        shifts = shift if isinstance(shift, list) else [shift] * len(body_outputs)
        whole = whole or [False] * len(body_outputs)
        for user in node.users:
            if user.target is operator.getitem and self._is_tensor(user):
                index = user.args[1]
                key = self._add(user, scope, module, multiplier, op="getitem")
                self._set_alias(key, self.key[body_outputs[index]], 0, shifts[index], whole[index])
                self._hop_getitems.add(user)

    def _scan(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        spec: ScanSpec = node.args[-1]
        if not isinstance(spec, ScanSpec):
            raise PassError(f"placement_graph: {node.format_node()}: last argument must be a hops.ScanSpec")
        operands = list(node.args[1:-1])
        xs = operands[spec.num_carry : spec.num_carry + spec.num_xs]
        length = int(self._meta(xs[0]).shape[0]) if xs else spec.length
        if length is None:
            raise PassError(f"placement_graph: {node.format_node()} has a symbolic length; the solver needs a static one")
        body = _body(node)
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        inputs: dict[fx.Node, Any] = {}
        # Leaf 0 of the scan node's args is its body; operand i is leaf i + 1.
        for i, (p, value) in enumerate(zip(placeholders, operands)):
            if not self._is_tensor(value):
                continue
            is_xs = spec.num_carry <= i < spec.num_carry + spec.num_xs
            # A carry's placeholder is fed by the init (and, below, by the step before).
            inputs[p] = ("feed", (value, 1 if is_xs else 0, multiplier, node, i + 1))
        body_scope = f"{scope}{node.args[0].target}/"
        body_outputs = self.walk(body, body_scope, multiplier * max(length, 1), inputs, materialize=spec.num_carry)
        # One step's carry output is the next step's carry input, redistributed between steps
        # when the two are laid out apart (the first step's comes from the init).
        for p, out in zip(placeholders[: spec.num_carry], body_outputs[: spec.num_carry]):
            carry_in, carry_out = self.key.get(p), self.key.get(out)
            if carry_in is None or carry_out is None or carry_in == carry_out or self.resolve(carry_out)[0] == carry_in:
                continue
            self._use(carry_out, carry_in, Use(UseKind.CARRY, 0, multiplier * max(length - 1, 0)))
            self.graph.edges[carry_out, carry_in]["loop"] = True
        # A stacked input is never split along the scanned dim: every step reads one slice of it
        # on every device.
        for value in xs:
            owner = self.key.get(value)
            if owner is not None and self.graph.nodes[owner]["kind"] is NodeKind.INPUT:
                data = self.graph.nodes[owner]
                data["strategies"] = [s for s in data["strategies"] if Shard(0) not in s.outputs[0]]
        shifts = [0] * spec.num_carry + [1] * (len(body_outputs) - spec.num_carry)
        whole = [True] * spec.num_carry + [False] * (len(body_outputs) - spec.num_carry)
        self._hop_outputs(node, scope, module, multiplier, body_outputs, shifts, whole)
        getitems = {user.args[1]: self.key[user] for user in node.users if user in self._hop_getitems}
        self.graph.graph.setdefault("scans", []).append(
            dict(
                node=node, scope=body_scope.rstrip("/"), length=length, multiplier=multiplier, reverse=spec.reverse,
                carry_in=[self.key.get(p) for p in placeholders[: spec.num_carry]],
                slices=[self.key.get(p) for p in placeholders[spec.num_carry : spec.num_carry + spec.num_xs]],
                carry_out=[self.key.get(o) for o in body_outputs[: spec.num_carry]],
                ys=[self.key.get(o) for o in body_outputs[spec.num_carry :]],
                results={index: key for index, key in getitems.items()},
                num_carry=spec.num_carry,
            )
        )

    # ------------------------------------------------------------------ ATen ops and kernels

    def _op(self, node: fx.Node, scope: str, module: fx.GraphModule, multiplier: int) -> None:
        inputs = self._tensor_inputs(node)
        key = self._add(node, scope, module, multiplier)
        strategies = self._strategies(node, inputs)
        if strategies is None:
            self.unsupported[_target_name(node.target)] += 1
            self.graph.nodes[key]["fallback"] = True
            strategies = [self._replicated_strategy(node, inputs)]
        self.graph.nodes[key]["strategies"] = strategies
        self._read_inputs(node, key, multiplier)

    def _output_metas(self, node: fx.Node) -> list[Any]:
        meta = self._meta(node)
        return list(meta) if isinstance(meta, (tuple, list)) else [meta]

    def _replicated_strategy(self, node: fx.Node, inputs: Sequence[fx.Node]) -> Strategy:
        replicated = _replicated(self.mesh)
        outputs = tuple(replicated if isinstance(m, torch.Tensor) else None for m in self._output_metas(node))
        return Strategy(outputs, tuple(replicated for _ in inputs))

    def _strategies(self, node: fx.Node, inputs: Sequence[fx.Node]) -> list[Strategy] | None:
        target = node.target
        if isinstance(target, Kernel):
            params = node.args[-1].as_dict() if node.args else {}
            if target.kernel_name == "einsum" and "equation" in params:
                return self._from_specs(node, inputs, lambda: self.rules.einsum_strategies(params["equation"]))
            return None
        if not isinstance(target, torch._ops.OpOverload) or not self.rules.has_rule(target):
            return None
        candidate_lists = {value: tuple(self.candidates(self.key[value])) for value in inputs}
        args = pytree.tree_map(lambda a: self._schema_arg(a), node.args)
        kwargs = pytree.tree_map(lambda a: self._schema_arg(a), dict(node.kwargs))
        out_metas = [
            _dtensor.tensor_meta(m.shape, m.dtype) if isinstance(m, torch.Tensor) else None
            for m in self._output_metas(node)
        ]
        out_meta = out_metas[0] if not isinstance(self._meta(node), (tuple, list)) else tuple(out_metas)

        def compute() -> list[Any]:
            return self.rules.op_strategies(
                target, args, kwargs, lambda arg: candidate_lists[arg.value], out_meta
            )

        # A rule written for one mesh axis is not shown the inputs' candidates (see
        # ``StrategyRules.op_strategies``): its strategies depend on shapes and arguments only.
        seen = None if self.rules.is_single_dim(target) else tuple(candidate_lists[v] for v in inputs)
        signature = (target, _signature(args), _signature(kwargs), seen)
        return self._from_specs(node, inputs, compute, signature)

    def _schema_arg(self, value: Any) -> Any:
        if not isinstance(value, fx.Node):
            return value
        meta = self._meta(value)
        if isinstance(meta, torch.Tensor):
            return _dtensor.TensorArg(_dtensor.tensor_meta(meta.shape, meta.dtype), value)
        return meta

    def _from_specs(self, node: fx.Node, inputs: Sequence[fx.Node], compute: Any, signature: Any = None) -> list[Strategy] | None:
        if signature is not None and signature in self._strategy_cache:
            return list(self._strategy_cache[signature])
        try:
            specs = compute()
        except Exception as error:  # DTensor refuses this call (an argument form its rule does not take)
            self.rule_errors.setdefault(_target_name(node.target), f"{type(error).__name__}: {error}"[:300])
            return None
        out_shapes = [
            tuple(m.shape) if isinstance(m, torch.Tensor) else None for m in self._output_metas(node)
        ]
        in_shapes = [tuple(self._meta(v).shape) for v in inputs]
        strategies: dict[Strategy, None] = {}
        for spec in specs:
            strategy = self._convert(spec, out_shapes, in_shapes)
            if strategy is not None:
                strategies[strategy] = None
        replicated = self._replicated_strategy(node, inputs)
        strategies.setdefault(replicated, None)
        result = tuple(strategies)
        if signature is not None:
            self._strategy_cache[signature] = result
        return list(result)

    def _convert(self, spec: Any, out_shapes: list, in_shapes: list) -> Strategy | None:
        output_specs = spec.output_specs
        output_specs = list(output_specs) if isinstance(output_specs, (tuple, list)) else [output_specs]
        if len(output_specs) != len(out_shapes):
            return None
        outputs = []
        for out_spec, shape in zip(output_specs, out_shapes):
            if shape is None or out_spec is None:
                outputs.append(None)
                continue
            placements = _dtensor.from_dtensor(out_spec.placements, len(shape))
            if placements is None or not _dtensor.splits_evenly(placements, shape, self.mesh):
                return None
            outputs.append(placements)
        input_specs = spec.input_specs
        if input_specs is None:
            if len(outputs) != 1:
                return None
            inputs = [outputs[0]] * len(in_shapes)
        else:
            input_specs = [s for s in input_specs if s is not None]
            if len(input_specs) != len(in_shapes):
                return None
            inputs = []
            for in_spec, shape in zip(input_specs, in_shapes):
                placements = _dtensor.from_dtensor(in_spec.placements, len(shape))
                if placements is None:
                    return None
                inputs.append(placements)
        for placements, shape in zip(inputs, in_shapes):
            if placements is None or not _dtensor.splits_evenly(placements, shape, self.mesh):
                return None
        return Strategy(tuple(outputs), tuple(inputs))


# The solver's view of each HOP: a method of ``_Builder`` adding the node (what placements it
# fixes, its body's scope and how the body's values are bound), or ``ordinary_op``: an op
# with DTensor strategies (a kernel; einsum's come from DTensor's einsum rule).
SOLVER_VIEW = "solver view"
hop_table(SOLVER_VIEW).update(
    {
        sharding_annotation_hop: _Builder._annotation,
        local_map_hop: _Builder._region,
        scan_hop: _Builder._scan,
        named_scope_hop: _Builder._named_scope,
        Kernel: ordinary_op,
    }
)


def _signature(value: Any) -> Any:
    """A hashable key for a node's schema arguments (tensors by shape and dtype)."""
    leaves, spec = pytree.tree_flatten(value, is_leaf=lambda v: isinstance(v, _dtensor.TensorArg))
    out = []
    for leaf in leaves:
        if isinstance(leaf, _dtensor.TensorArg):
            out.append(("tensor", tuple(leaf.meta.shape), leaf.meta.dtype))
        else:
            try:
                hash(leaf)
                out.append(leaf)
            except TypeError:
                out.append(repr(leaf))
    return (tuple(out), str(spec))


def _body(node: fx.Node) -> fx.GraphModule | None:
    bodies = _bodies(node)
    return bodies[0][1] if len(bodies) == 1 else None


def _bodies(node: fx.Node) -> list[tuple[fx.Node, fx.GraphModule]]:
    """A HOP node's bodies with their ``get_attr``: its first argument, or each of the tuple
    of them a region with alternatives takes (one per alternative, in order)."""
    first = node.args[0] if node.args else None
    found = []
    for body in first if isinstance(first, (tuple, list)) else [first]:
        if isinstance(body, fx.Node) and body.op == "get_attr":
            module = node.graph.owning_module.get_submodule(str(body.target))
            if isinstance(module, fx.GraphModule):
                found.append((body, module))
    return found


def as_program(gm: Any, where: str) -> list[tuple[str, fx.GraphModule]]:
    """``(scope, graph)`` pairs: one graph, or a forward and its backward (scopes ``forward/``, ``backward/``)."""
    if isinstance(gm, fx.GraphModule):
        return [("", gm)]
    if isinstance(gm, (tuple, list)) and len(gm) == 2 and all(isinstance(m, fx.GraphModule) for m in gm):
        return [("forward/", gm[0]), ("backward/", gm[1])]
    raise TypeError(
        f"{where}: gm must be a torch.fx.GraphModule or a (forward, backward) pair of them, got {type(gm).__name__}"
    )


def placement_graph(gm: Any, mesh: Mesh, *, example_inputs: Sequence[Any] | None = None) -> nx.DiGraph:
    """The networkx view of ``gm`` (a GraphModule, or AOTAutograd's ``(forward, backward)``) on ``mesh``.

    See the module docstring for nodes, attributes and edges. ``example_inputs`` (the program's
    inputs, real or fake) are needed only when ``node.meta["val"]`` is missing. Raises
    ``TypeError`` for a wrong ``gm`` or ``mesh``, ``PassError`` for a graph it cannot place (a HOP
    on another mesh, a scan of symbolic length, deleted metadata without ``example_inputs``).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"placement_graph(mesh=...) must be a hops.Mesh, got {type(mesh).__name__}")
    program = as_program(gm, "placement_graph")
    with _dtensor.fake_device_mesh(mesh) as device_mesh, _dtensor.free_redistribute_costs():
        return _build(program, mesh, example_inputs, _dtensor.StrategyRules(mesh, device_mesh))


def _build(program: list, mesh: Mesh, example_inputs: Any, rules: _dtensor.StrategyRules) -> nx.DiGraph:
    values = value_metadata([m for _, m in program], example_inputs, "placement_graph")
    builder = _Builder(mesh, values, rules)
    scope, forward = program[0]
    outputs = builder.walk(forward, scope, 1)
    forward_inputs = [builder.key.get(p) for p in forward.graph.find_nodes(op="placeholder")]
    for key in forward_inputs:
        if key is not None:
            builder.graph.nodes[key]["role"] = "input"
    if len(program) == 2:
        _, backward = program[1]
        saved, tangents = split_backward_inputs(backward)
        if len(saved) > len(outputs):
            raise PassError(
                f"placement_graph: the backward reads {len(saved)} saved values but the forward returns {len(outputs)}"
            )
        saved_values = outputs[len(outputs) - len(saved) :]
        bindings = {p: ("saved", v) for p, v in zip(saved, saved_values) if builder._is_tensor(v)}
        grads = builder.walk(backward, program[1][0], 1, bindings)
        for value in saved_values:
            key = builder.key.get(value) if isinstance(value, fx.Node) else None
            if key is not None and builder.graph.nodes[key]["role"] is None:
                builder.graph.nodes[key]["role"] = "activation"
        # The gradient of each forward input is laid out like the input (the optimizer
        # updates them together).
        output = next(iter(backward.graph.find_nodes(op="output")))
        # The output's args are ``(grads,)``: grad k is leaf k (a missing gradient is a None leaf).
        for position, (key, grad) in enumerate(zip(forward_inputs, grads)):
            if key is None or not builder._is_tensor(grad):
                continue
            builder.graph.nodes[key]["role"] = "parameter"
            builder._use(grad, key, Use(UseKind.VALUE, 0, 1, output, position))
            builder.graph.edges[builder.key[grad], key]["gradient"] = True
            # That is how the gradient leaves the backward: one redistribution, to its
            # parameter's (whole) layout, in place of reducing it first and moving it after.
            builder.drop_output_use(builder.key[grad], builder.key[output], position)
    _collapse_unit_axes(builder.graph, mesh)
    builder.graph.graph.update(
        program=program,
        unsupported_ops=dict(builder.unsupported),
        rule_errors=builder.rule_errors,
    )
    return builder.graph


def _collapse_unit_axes(graph: nx.DiGraph, mesh: Mesh) -> None:
    """On a mesh axis of size 1, ``Shard`` and ``Partial`` hold the whole value on the one
    device: they are ``Replicate``. Every strategy says so, and a node's strategies that then
    coincide are kept once (a fixed node keeps its list: a region's k-th strategy is its k-th
    body). Without this, a 2x2x1 mesh offered each op every layout of the size-1 axis too:
    ~20x the integer program's variables of the same program on 2x2, for no other plan."""
    unit = [size == 1 for size in mesh.shape]
    if not any(unit):
        return

    def collapse(placements: Placements | None) -> Placements | None:
        if placements is None:
            return None
        return tuple(Replicate() if one else p for p, one in zip(placements, unit))

    for _, data in graph.nodes(data=True):
        strategies = data.get("strategies")
        if not strategies:
            continue
        collapsed = [
            Strategy(tuple(map(collapse, s.outputs)), tuple(map(collapse, s.inputs)), s.cost_hint) for s in strategies
        ]
        data["strategies"] = collapsed if data["fixed"] else list(dict.fromkeys(collapsed))
