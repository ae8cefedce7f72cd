"""``solve_placements``: the cheapest placement of every value of a traced program."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import networkx as nx
import numpy as np
import torch
import torch.fx as fx

from hops.specs import Mesh, Shard
from passes._infra import PassError
from passes.solver.collectives import predicted_collectives
from passes.solver.cost import CostModel
from passes.solver.deadline import collector_paused
from passes.solver.graph import (
    NodeKind,
    Strategy,
    UseKind,
    arrives_whole,
    is_view,
    materialized,
    placement_graph,
    read_as,
    required_placement,
    shift_placements,
)
from passes.solver.problem import InfeasiblePlacementError, NoPlanFoundError, StrategyProblem, peak_usage, problem_cost
from passes.solver.search import solve_problem

__all__ = ["PlacementSolution", "solve_placements", "InfeasiblePlacementError", "placement_problem"]


@dataclasses.dataclass
class PlacementSolution:
    """The solved placements of a program.

    ``placements``: the placement of every tensor value, by ``placement_graph`` node name;
    ``strategies``: the chosen ``Strategy`` of every node that has strategies;
    ``cost``: seconds per run of the program under the cost model (compute + communication);
    ``memory``: the peak bytes per device over the program's run (parameters with their
    gradients and optimizer state and inputs all along, every other value of the program's
    graphs while it is live; see ``memory_terms``);
    ``stats``: ``variables``, ``constraints``, ``build_seconds``, ``solve_seconds``,
    ``graph_seconds``, ``status``, ``unsupported_ops`` (ops without a DTensor rule, run replicated),
    and the sizes before and after the exact reductions; ``search``: ``"exact"`` or ``"axes"``
    (then ``variables`` is the largest of the ``ilps`` integer programs solved);
    ``graph``: the ``placement_graph`` it was solved on.
    """

    placements: dict[str, tuple]
    strategies: dict[str, Strategy]
    cost: float
    memory: float
    stats: dict
    graph: nx.DiGraph
    mesh: Mesh
    cost_model: CostModel

    def region_choice(self, name: str) -> int:
        """Index of the alternative chosen for the region node ``name``."""
        strategy = self.strategies[name]
        return self.graph.nodes[name]["strategies"].index(strategy)

    def collectives(self, graph: str | None = None, *, device_type: str | None = None) -> dict[str, int]:
        """The collectives one run of the plan issues, by kind (``"all_gather"``, ``"all_reduce"``,
        ``"reduce_scatter"``, ``"all_to_all"``; kinds with none left out): one per mesh axis of every
        redistribution the cost model prices, counted as often as the graph reading the value runs
        (in a scan body once per step; a scan's operands once, before its loop).

        That is what ``CommDebugMode`` counts (``passes.dtensor.collective_counts``) when the plan,
        stated by ``apply_placements``, runs lowered by ``lower_to_dtensor`` on inputs laid out as
        solved or replicated. ``graph``: ``"forward"`` or ``"backward"`` of a ``(forward, backward)``
        program; ``None``: all of it. A graph's outputs are reduced before they leave it, so a saved
        value and a scan's carry arrive without a pending sum; a scan's stacked ys keep their
        steps' pending sums, reduced once after the loop where they are read in another layout.
        ``device_type="cpu"``: DTensor runs ``Shard(i) -> Shard(j)`` on CPU meshes as an all-gather
        and a local chunk (gloo has no all-to-all), so it is counted as ``"all_gather"``.
        """
        return predicted_collectives(self, graph, device_type=device_type)


@dataclasses.dataclass
class Factor:
    """Cost ``table[rows[i], cols[j]]`` when choice ``a`` takes option ``i`` and ``b`` option ``j``."""

    a: int
    b: int
    rows: np.ndarray  # class of each option of a
    cols: np.ndarray  # class of each option of b
    table: np.ndarray  # seconds; inf: not allowed


@dataclasses.dataclass
class MemoryTerm:
    """Bytes per device a value takes while it is live, ``[start, end)`` in program order,
    per option of the choice that places it."""

    choice: int
    start: int
    end: int
    usage: np.ndarray


def _itemsize(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else torch.empty((), dtype=dtype).element_size()


def _local_numel(shape: Sequence[int], placements: Sequence[Any], mesh: Mesh) -> float:
    ways = 1
    for size, p in zip(mesh.shape, placements):
        if isinstance(p, Shard):
            ways *= size
    return math.prod(shape) / ways


def _local(shape: Sequence[int] | None, placements: Sequence[Any] | None, mesh: Mesh) -> tuple[int, ...] | None:
    if shape is None:
        return None
    if placements is None:
        return tuple(shape)
    out = list(shape)
    for size, p in zip(mesh.shape, placements):
        if isinstance(p, Shard):
            out[p.dim] //= size
    return tuple(out)


class _ProblemBuilder:
    def __init__(self, graph: nx.DiGraph, mesh: Mesh, cost_model: CostModel) -> None:
        self.graph = graph
        self.mesh = mesh
        self.cost_model = cost_model
        self.owners = [
            n for n, d in graph.nodes(data=True) if d["strategies"] is not None and d["kind"] is not NodeKind.LOCAL
        ]
        self.index = {n: i for i, n in enumerate(self.owners)}
        self._redistribute_cache: dict[tuple, float] = {}
        self._resolved: dict[str, tuple[str, int, int]] = {}
        self._whole: dict[str, bool] = {}
        self._axis_codes: dict[tuple, int] = {}
        self._table_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._shapes: dict[str, tuple[list, list]] = {}
        self._compute_cache: dict[tuple, float] = {}
        self._strategy_codes: dict[int, tuple[int, ...]] = {}
        # Every cache lives as long as this builder, which lives for one solve (or one evaluation):
        # nothing is written into the graph it was handed, so a graph changed between two solves,
        # or solved under another cost model, is priced as it is now.
        self._body_seconds: dict[tuple[str, int], float] = {}  # (region, alternative) -> its body's compute

    def resolve(self, key: str) -> tuple[str, int, int]:
        if key in self._resolved:
            return self._resolved[key]
        index, shift, current = 0, 0, key
        while True:
            alias = self.graph.nodes[current]["alias"]
            if alias is None:
                break
            current, index, shift = alias[0], alias[1], shift + alias[2]
        self._resolved[key] = (current, index, shift)
        return current, index, shift

    def whole(self, key: str) -> bool:
        """``key`` arrives without a pending sum (``graph.arrives_whole``)."""
        if key not in self._whole:
            self._whole[key] = arrives_whole(self.graph, key)
        return self._whole[key]

    def project(self, key: str, placements: tuple | None, shift: int = 0) -> tuple | None:
        """The placement of ``key`` when its owner's output is ``placements`` (``shift``: more dims in front)."""
        placements = shift_placements(placements, shift)
        return materialized(placements) if self.whole(key) else placements

    def placement(self, key: str, option: int) -> tuple | None:
        owner, index, shift = self.resolve(key)
        return self.project(key, self.graph.nodes[owner]["strategies"][option].outputs[index], shift)

    def redistribute(self, shape: tuple, itemsize: int, source: Any, target: Any) -> float:
        key = (shape, itemsize, id(source), id(target))  # placements are canonical objects
        if key not in self._redistribute_cache:
            self._redistribute_cache[key] = self.cost_model.redistribute_seconds(shape, itemsize, source, target, self.mesh)
        return self._redistribute_cache[key]

    def redistribute_table(self, shape: tuple, itemsize: int, sources: Sequence[Any], targets: Sequence[Any]) -> np.ndarray:
        """``redistribute`` from each of ``sources`` to each of ``targets``: the shape-free terms
        of every pair (``CostModel.redistribute_terms_table``) are made once per pair of lists."""
        key = (tuple(map(id, sources)), tuple(map(id, targets)))
        terms = self._table_cache.get(key)
        if terms is None:
            terms = self._table_cache[key] = self.cost_model.redistribute_terms_table(sources, targets, self.mesh)
        return terms[0] + terms[1] * float(math.prod(shape) * itemsize)

    # ---------------------------------------------------------------- compute

    def compute_cost(self, key: str, strategy: Strategy) -> float:
        data = self.graph.nodes[key]
        if data["kind"] in (NodeKind.INPUT, NodeKind.ANNOTATION):
            return 0.0
        if data["kind"] is NodeKind.REGION:
            return self.region_cost(key, strategy)
        node = data["fx_node"]
        if is_view(node.target) or data["op"] == "getitem":
            return 0.0
        if key not in self._shapes:  # the same for every strategy of the node
            inputs = [self.graph.nodes[u]["shape"] for u in self._input_keys(key)]
            self._shapes[key] = (inputs, self._output_shapes(key))
        inputs, outputs = self._shapes[key]
        input_shapes = tuple(_local(d, p, self.mesh) for d, p in zip(inputs, strategy.inputs))
        output_shapes = tuple(_local(s, p, self.mesh) if p is not None else None for s, p in zip(outputs, strategy.outputs))
        itemsize = _itemsize(data["dtype"]) or 4
        if data["op"].startswith("hops_kernel") and node.args:
            params = node.args[-1].as_dict()
            return self.cost_model.compute_seconds(node.target, input_shapes, output_shapes, itemsize, params)
        # Strategies of one op, and ops alike, share local shapes: each roofline is taken once.
        memo = (node.target, input_shapes, output_shapes, itemsize)
        if memo not in self._compute_cache:
            self._compute_cache[memo] = self.cost_model.compute_seconds(node.target, input_shapes, output_shapes, itemsize)
        return self._compute_cache[memo]

    def _input_keys(self, key: str) -> list[str]:
        slots: dict[int, str] = {}
        for u, _, data in self.graph.in_edges(key, data=True):
            for use in data["uses"]:
                if use.kind is UseKind.INPUT:
                    slots[use.index] = u
        return [slots[i] for i in sorted(slots)]

    def _output_shapes(self, key: str) -> list:
        data = self.graph.nodes[key]
        if data["shape"] is not None:
            return [data["shape"]]
        shapes = data.get("output_shapes")
        if shapes is not None:
            return shapes
        # a multi-output op: its getitems carry the shapes
        out: dict[int, Any] = {}
        for _, v in self.graph.out_edges(key):
            alias = self.graph.nodes[v]["alias"]
            if alias is not None and alias[0] == key:
                out[alias[1]] = self.graph.nodes[v]["shape"]
        n = len(self.graph.nodes[key]["strategies"][0].outputs)
        return [out.get(i) for i in range(n)]

    def region_cost(self, key: str, strategy: Strategy) -> float:
        """A region's cost under ``strategy`` (one of its alternatives): the alternative's cost
        hint, else the compute of that alternative's own body on its own local shapes (each
        alternative's body is traced on its local shapes and placed under its own scope; the
        region names its body's values, ``body_values``)."""
        if strategy.cost_hint is not None:
            return float(strategy.cost_hint)
        data = self.graph.nodes[key]
        memo = (key, data["strategies"].index(strategy))
        seconds = self._body_seconds  # the builder's own: the caller's graph is only read
        if memo not in seconds:
            total = 0.0
            for name in data["body_values"][memo[1]]:
                body = self.graph.nodes[name]
                if body["kind"] is not NodeKind.LOCAL or body["fx_node"].op != "call_function":
                    continue
                node = body["fx_node"]
                if is_view(node.target):
                    continue
                ins = [self.graph.nodes[u]["shape"] for u in self.graph.predecessors(name) if self.graph.nodes[u]["shape"]]
                itemsize = _itemsize(body["dtype"]) or 4
                total += self.cost_model.compute_seconds(node.target, ins, [body["shape"]] if body["shape"] else [], itemsize)
            seconds[memo] = total
        return seconds[memo]

    def residual_ties(self) -> list[Factor]:
        """A backward region reading a forward region's residuals (per-device values only the
        alternative that made them can read: ``LocalMapSpec.residuals``) takes the same
        alternative: a factor allowing equal options only."""
        factors, seen = [], set()
        for u, v, data in self.graph.edges(data=True):
            if self.graph.nodes[v]["kind"] is not NodeKind.REGION or not any(use.kind is UseKind.INPUT for use in data["uses"]):
                continue
            owner, index, _ = self.resolve(u)
            source = self.graph.nodes[owner]
            if source["kind"] is not NodeKind.REGION or not source["residuals"]:
                continue
            if index < len(source["strategies"][0].outputs) - source["residuals"] or (owner, v) in seen:
                continue
            seen.add((owner, v))
            count = len(source["strategies"])
            if len(self.graph.nodes[v]["strategies"]) != count:
                raise PassError(
                    f"solve_placements: region {v} reads the residuals of region {owner} but has "
                    f"{len(self.graph.nodes[v]['strategies'])} alternatives, not {count}"
                )
            table = np.where(np.eye(count, dtype=bool), 0.0, np.inf)
            options = np.arange(count, dtype=np.int64)
            factors.append(Factor(self.index[owner], self.index[v], options, options, table))
        return factors

    # ---------------------------------------------------------------- memory

    def memory_terms(self) -> list[MemoryTerm]:
        """Each value of the program's graphs (forward, then backward) as a ``MemoryTerm``: live
        from the node that makes it to its last reader (a saved activation to its last reader
        in the backward; a view or an annotation keeps what it reads live), parameters (with
        their gradients and optimizer state) and inputs for the whole program. Values inside a
        HOP's body (a scan step's, a region's) live while it runs and are not counted."""
        positions: dict[fx.Node, int] = {}
        for _, module in self.graph.graph["program"]:
            for node in module.graph.nodes:
                positions[node] = len(positions)
        end_of_program = len(positions)
        factor = {"parameter": 2.0 + self.cost_model.optimizer_state_bytes, "input": 1.0}
        storage: dict[str, list[int]] = {}  # value that holds its storage -> [start, end]
        for key, data in self.graph.nodes(data=True):
            node = data.get("fx_node")
            if node not in positions or data["shape"] is None or data["kind"] in (NodeKind.OUTPUT, NodeKind.REGION, NodeKind.LOCAL):
                continue
            start = end = positions[node]
            for _, _, edge in self.graph.out_edges(key, data=True):
                for use in edge["uses"]:
                    if use.reader in positions:
                        end = max(end, positions[use.reader])
            span = storage.setdefault(self._storage_of(key, positions), [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
        terms = []
        for key, (start, end) in storage.items():
            data = self.graph.nodes[key]
            owner, _, _ = self.resolve(key)
            if owner not in self.index:
                continue
            role = data.get("role")
            if role in factor:
                start, end = 0, end_of_program
            itemsize = _itemsize(data["dtype"]) * factor.get(role, 1.0)
            options = len(self.graph.nodes[owner]["strategies"])
            usage = np.zeros(options)
            for option in range(options):
                placements = self.placement(key, option)
                if placements is not None:
                    usage[option] = itemsize * _local_numel(data["shape"], placements, self.mesh)
            terms.append(MemoryTerm(self.index[owner], start, end + 1, usage))
        return terms

    def _storage_of(self, key: str, positions: dict) -> str:
        """The value whose storage ``key`` is: itself, or (a view of a value of the same graph,
        an annotation) the value it reads."""
        data = self.graph.nodes[key]
        if data["kind"] is NodeKind.ANNOTATION:
            sources = [
                u for u in self.graph.predecessors(key)
                if self.graph.nodes[u].get("fx_node") in positions and self.graph.nodes[u]["shape"] is not None
            ]
            return self._storage_of(sources[0], positions) if sources else key
        alias = data.get("alias")
        target = None if alias is None else self.graph.nodes[alias[0]]
        if target is not None and target.get("fx_node") in positions and target["shape"] is not None:
            return self._storage_of(alias[0], positions)
        return key

    # ---------------------------------------------------------------- the problem

    def axis_codes(self, strategies: Sequence[Strategy]) -> np.ndarray:
        """Per strategy, a code per mesh axis naming what it places on that axis (every output
        and input): the ``axes`` of its node (see ``passes.solver.problem.StrategyProblem``)."""
        codes = self._axis_codes
        out = np.empty((len(strategies), self.mesh.ndim), dtype=np.int64)
        for i, strategy in enumerate(strategies):
            row = self._strategy_codes.get(id(strategy))
            if row is None:
                placements = (*strategy.outputs, *strategy.inputs)
                row = tuple(
                    codes.setdefault(tuple(None if p is None else p[axis] for p in placements), len(codes))
                    for axis in range(self.mesh.ndim)
                )
                self._strategy_codes[id(strategy)] = row
            out[i] = row
        return out

    def build(self, memory_budget: float | None = None) -> StrategyProblem:
        """The graph's problem: node i < ``len(owners)`` is the choice of ``owners[i]``'s strategy
        (its compute seconds, times how often it runs; its per-axis codes; the first value it
        places as its memory term); each read of a value an edge between the value's choice and
        the reader's, its table over the classes of equal placements; each further value a
        choice places a node of its own (its distinct usages as strategies), tied to the choice
        by an edge. ``memory_budget``: the usage limit. ``self.ties`` maps the tie nodes."""
        costs, axes = [], []
        for key in self.owners:
            data = self.graph.nodes[key]
            costs.append(np.array([self.compute_cost(key, s) * data["multiplier"] for s in data["strategies"]], dtype=float))
            axes.append(self.axis_codes(data["strategies"]))
        choices = costs
        memory_terms = self.memory_terms()
        factors = []
        for u, v, data in self.graph.edges(data=True):
            if not data["uses"]:
                continue
            source = self.graph.nodes[u]
            if source["kind"] is NodeKind.LOCAL:
                continue
            owner_u, index_u, shift_u = self.resolve(u)
            strategies_u = self.graph.nodes[owner_u]["strategies"]
            produced = [self.project(u, s.outputs[index_u], shift_u) for s in strategies_u]
            rows, row_values = _classes(produced)
            itemsize = _itemsize(source["dtype"])
            for use in data["uses"]:
                if use.kind is UseKind.OUTPUT:
                    # Reducing a pending sum before the value leaves its graph: a cost of u's choice.
                    seconds = np.array(
                        [self.redistribute(source["shape"], itemsize, p, materialized(p)) for p in row_values]
                    ) * use.multiplier
                    choices[self.index[owner_u]] = choices[self.index[owner_u]] + seconds[rows]
                    continue
                if use.kind is UseKind.INPUT:
                    owner_v, strategies_v = v, self.graph.nodes[v]["strategies"]
                    required = [s.inputs[use.index] for s in strategies_v]
                else:
                    owner_v, index_v, shift_v = self.resolve(v)
                    strategies_v = self.graph.nodes[owner_v]["strategies"]
                    required = [self.project(v, s.outputs[index_v], shift_v + use.index) for s in strategies_v]
                cols, col_values = _classes(required)
                shape = use.shape or source["shape"]
                if use.kind is UseKind.CARRY:  # read as it left its step: fresh layouts, not the cached lists
                    terms = self.cost_model.redistribute_terms_table([read_as(use, p) for p in row_values], col_values, self.mesh)
                    table = (terms[0] + terms[1] * float(math.prod(shape) * itemsize)) * use.multiplier
                else:
                    table = self.redistribute_table(shape, itemsize, row_values, col_values) * use.multiplier
                factors.append(Factor(self.index[owner_u], self.index[owner_v], rows, cols, table))
        factors.extend(self.residual_ties())
        return self._problem(costs, axes, factors, memory_terms, memory_budget)

    def _problem(self, costs: list, axes: list, factors: list[Factor], terms: list[MemoryTerm], memory_budget: float | None) -> StrategyProblem:
        problem, self.ties = choice_problem(costs, factors, terms, memory_budget, axes)
        return problem

    def full_plan(self, options: Sequence[int]) -> list[int]:
        """A strategy per node of the last ``build``'s problem from an option per choice."""
        return full_plan(self.ties, options)



def choice_problem(
    costs: Sequence[np.ndarray],
    factors: Sequence[Factor],
    terms: Sequence[MemoryTerm],
    memory_budget: float | None = None,
    axes: Sequence[np.ndarray | None] | None = None,
) -> tuple[StrategyProblem, list[tuple[int, np.ndarray]]]:
    """Choices (an option cost array each), factors between them and memory terms as one
    ``StrategyProblem``: node i < ``len(costs)`` is choice i; a factor is an edge with its class
    table (a factor of a choice with itself, costs); a choice's first term gives its node's
    usages and interval, each further term is a node of its own (the term's distinct usages as
    strategies, zero cost), tied to the choice's option by an edge (0 where they agree,
    forbidden elsewhere). Returns the problem and the ties (per node after the choices: its
    choice and its strategy per option of the choice, for ``full_plan``)."""
    costs = [np.asarray(c, dtype=np.float64).copy() for c in costs]
    n = len(costs)
    usages = [np.zeros(len(c)) for c in costs]
    intervals = [(0, 0)] * n
    axes = [None] * n if axes is None else list(axes)
    edges, tables, classes = [], [], []
    for f in factors:
        if f.a == f.b:
            costs[f.a] = costs[f.a] + f.table[f.rows, f.cols]
            continue
        edges.append((f.a, f.b))
        tables.append(f.table)
        classes.append((f.rows, f.cols))
    ties: list[tuple[int, np.ndarray]] = []
    placed: set[int] = set()
    for term in terms:
        if term.choice not in placed:
            placed.add(term.choice)
            usages[term.choice] = np.asarray(term.usage, dtype=np.float64)
            intervals[term.choice] = (term.start, term.end)
            continue
        values, of_option = np.unique(term.usage, return_inverse=True)
        of_option = of_option.reshape(-1)
        edges.append((term.choice, len(costs)))
        tables.append(np.where(np.eye(len(values), dtype=bool), 0.0, np.inf))
        classes.append((of_option, np.arange(len(values))))
        costs.append(np.zeros(len(values)))
        usages.append(values)
        intervals.append((term.start, term.end))
        axes.append(None)
        ties.append((term.choice, of_option))
    if not costs:  # (nothing to place: one node of one strategy)
        costs, usages, intervals, axes = [np.zeros(1)], [np.zeros(1)], [(0, 0)], [None]
    problem = StrategyProblem(
        tuple(costs), tuple(usages), np.array(intervals, dtype=np.int64).reshape(-1, 2),
        np.array(edges, dtype=np.int64).reshape(-1, 2), tuple(tables), memory_budget,
        edge_classes=tuple(classes), axes=tuple(axes),
    )
    return problem, ties


def full_plan(ties: Sequence[tuple[int, np.ndarray]], options: Sequence[int]) -> list[int]:
    """A strategy per node of ``choice_problem``'s problem from an option per choice."""
    plan = [int(o) for o in options]
    plan += [int(of_option[plan[choice]]) for choice, of_option in ties]
    return plan or [0]


def _classes(values: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    """Class of each value (equal placements are one canonical object: keyed by identity)."""
    index: dict[int, int] = {}
    distinct: list[Any] = []
    rows = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        k = id(value)
        if k not in index:
            index[k] = len(distinct)
            distinct.append(value)
        rows[i] = index[k]
    return rows, distinct


def placement_problem(
    graph: nx.DiGraph, cost_model: CostModel | None = None, memory_budget: float | None = None
) -> tuple[StrategyProblem, list[str]]:
    """The problem of ``graph`` (``_ProblemBuilder.build``) under ``memory_budget``, and the
    graph node whose strategy each of its first ``len(owners)`` nodes chooses; ``write_iopddl``
    writes it in the contest's format."""
    builder = _ProblemBuilder(graph, graph.graph["mesh"], cost_model or CostModel.preset("h100"))
    return builder.build(memory_budget), builder.owners


def solve_placements(
    gm: Any,
    mesh: Mesh,
    *,
    cost_model: CostModel | None = None,
    memory_budget: float | None = None,
    example_inputs: Sequence[Any] | None = None,
    time_limit: float | None = None,
    search: str = "auto",
) -> PlacementSolution:
    """Place every value of ``gm`` (a GraphModule, or AOTAutograd's ``(forward, backward)``) on ``mesh``.

    Minimizes compute plus redistribution seconds under ``cost_model`` (default: the ``h100``
    preset), honouring every placement the program's HOPs fix, and, with ``memory_budget``
    (bytes per device), keeping parameters, gradients, optimizer state, inputs and saved
    activations within it. A scan body is solved once: its choices hold for every step and
    its costs count once per step. Exact: the graph's ``StrategyProblem`` solved by
    ``passes.solver.solve_problem`` (exact reductions, then HiGHS); ``time_limit`` (seconds)
    stops it early with the best plan found (large neighbourhoods of it, memory priced, where
    the whole program does not finish in time). ``search``:
    ``"exact"`` always solves that one program; ``"axes"`` searches mesh-axis neighbourhoods on
    meshes of 3 or more axes (each an exact program, the plan not proven optimal:
    ``stats["status"]`` says so); ``"auto"`` (default) does ``"axes"`` only when the exact program
    would exceed 400k pair variables (3-D meshes at production sizes). Raises
    ``InfeasiblePlacementError`` when no placement fits the budget and the fixed placements,
    ``TypeError``/``ValueError`` for bad arguments.
    """
    if cost_model is None:
        cost_model = CostModel.preset("h100")
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"solve_placements(cost_model=...) must be a CostModel, got {type(cost_model).__name__}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or memory_budget <= 0):
        raise ValueError(f"solve_placements(memory_budget=...) must be a positive number of bytes per device, got {memory_budget!r}")
    start = time.perf_counter()
    with collector_paused(time_limit is not None):  # (the limit counts the graph's building too)
        graph = placement_graph(gm, mesh, example_inputs=example_inputs)
        graph_seconds = time.perf_counter() - start
        return solve_graph(
            graph, cost_model=cost_model, memory_budget=memory_budget,
            time_limit=time_limit, graph_seconds=graph_seconds, search=search,
        )


def solve_graph(
    graph: nx.DiGraph,
    *,
    cost_model: CostModel,
    memory_budget: float | None = None,
    time_limit: float | None = None,
    graph_seconds: float = 0.0,
    reduce: bool = True,
    search: str = "auto",
) -> PlacementSolution:
    """``solve_placements`` on a ``placement_graph`` already built."""
    mesh = graph.graph["mesh"]
    start = time.perf_counter()
    # (Everything counted in ``problem_seconds`` is spent of the time limit: paused as the solve is.)
    with collector_paused(time_limit is not None):
        builder = _ProblemBuilder(graph, mesh, cost_model)
        problem = builder.build(memory_budget)
        if memory_budget is not None:
            least = [int(np.argmin(u)) for u in problem.node_usages]
            smallest = peak_usage(problem, least)
            if smallest > memory_budget:
                raise InfeasiblePlacementError(
                    f"memory_budget={memory_budget:.6g} bytes per device is below the smallest footprint any "
                    f"placement allows ({smallest:.6g} bytes at its peak: every parameter, gradient, optimizer state "
                    "and live value sharded as far as its strategies go)"
                )
    problem_seconds = time.perf_counter() - start
    if time_limit is not None:
        # The limit counts from the call: the graph's and the problem's building are spent of
        # it (past it, ``solve_problem`` answers with a plan read off the problem, at once).
        time_limit = max(1e-3, time_limit - graph_seconds - problem_seconds)
    # (Only equal strategies merged: a scan's problem does not change with its trip count.)
    result = _solve_with_budget(problem, memory_budget, time_limit, reduce, search, graph_seconds + problem_seconds)
    options = result.strategies[: len(builder.owners)]
    strategies = {key: graph.nodes[key]["strategies"][option] for key, option in zip(builder.owners, options)}
    option_of = dict(zip(builder.owners, options))
    placements = {}
    for key, data in graph.nodes(data=True):
        if data["kind"] in (NodeKind.LOCAL, NodeKind.REGION) or data["shape"] is None:
            continue
        owner, _, _ = builder.resolve(key)
        if owner in option_of:
            placements[key] = builder.placement(key, option_of[owner])
    stats = dict(result.stats)
    stats.update(
        build_seconds=problem_seconds + stats["reduce_seconds"],
        solve_seconds=stats["seconds"] - stats["reduce_seconds"],
        choices=len(builder.owners),
        choices_in_ilp=stats["nodes_left"],
    )
    stats.update(
        graph_seconds=graph_seconds,
        unsupported_ops=dict(graph.graph.get("unsupported_ops", {})),
        graph_nodes=graph.number_of_nodes(),
    )
    return PlacementSolution(
        placements=placements,
        strategies=strategies,
        cost=result.cost,
        memory=peak_usage(problem, result.strategies),
        stats=stats,
        graph=graph,
        mesh=mesh,
        cost_model=cost_model,
    )


# A budgeted solve without a time limit gets this many times what the unbudgeted call took
# (its graph, its problem and its solve; the graph is most of it at production sizes), at
# least ``_BUDGET_MIN_SECONDS`` (the search's workers start in about that), after the
# unbudgeted solve: the caller pays 2-2.6x the unbudgeted call, within the 3x the FX front
# promises (a floor of 2 s made the 4-layer scan of benchmarks/solver_scaling.py 3.9x). The
# integer program with memory rows is far slower to prove (the decoder of
# examples/auto_shard.py, dim 256 on 2x2: 3 s of CPU without a budget, 66 s at 0.8x the
# unbudgeted peak, most of it in HiGHS's root LP and its cuts), so the plan is the search's
# best in that time: that decoder at 0.8x and 0.6x ends 1.04-1.05x the plan of a 30 s search,
# HF Llama (dim 256, 2x2) at 0.6x about 1.4x a 60 s one.
_BUDGET_TIME_FACTOR = 1.6
_BUDGET_MIN_SECONDS = 0.25


def _solve_with_budget(problem: StrategyProblem, memory_budget, time_limit, reduce, search, spent: float = 0.0):
    """``solve_problem`` of the FX front's problem. With a budget and no time limit: solved
    without the budget first (exact); that plan if it fits (then optimal), else the budgeted
    search started from it, for ``_BUDGET_TIME_FACTOR`` times that solve and the ``spent``
    seconds of building its graph and problem (its status and lower bound say how close); the
    exact program where that search found no plan."""
    options = dict(reduce=reduce, search=search, dominance="equal", presolve=False)
    if memory_budget is None or time_limit is not None:
        return solve_problem(problem, time_limit=time_limit, **options)
    began = time.perf_counter()
    free = solve_problem(problem.with_usage_limit(None), **options)
    took = time.perf_counter() - began
    if peak_usage(problem, free.strategies) <= memory_budget:
        return free
    limit = max(_BUDGET_MIN_SECONDS, _BUDGET_TIME_FACTOR * (spent + took))
    try:
        result = solve_problem(problem, time_limit=limit, start=free.strategies, **options)
    except NoPlanFoundError:
        # (The caller asked for no time limit: a plan, or a proof that there is none.)
        result = solve_problem(problem, start=free.strategies, **options)
    result.stats["unbudgeted_seconds"] = took
    return result


def evaluate_placements(graph: nx.DiGraph, strategies: dict[str, Strategy], cost_model: CostModel) -> float:
    """Seconds of the given strategy per node (every node with strategies) under ``cost_model``."""
    builder = _ProblemBuilder(graph, graph.graph["mesh"], cost_model)
    problem = builder.build()
    options = [graph.nodes[key]["strategies"].index(strategies[key]) for key in builder.owners]
    return problem_cost(problem, builder.full_plan(options))


def node_costs(solution: PlacementSolution) -> dict[str, tuple[float, float]]:
    """Per node with a strategy: ``(compute, communication)`` seconds of one run of it under the
    solution (communication: redistributing what it reads, or what it leaves its graph with),
    not multiplied by its trip count."""
    graph = solution.graph
    builder = _ProblemBuilder(graph, solution.mesh, solution.cost_model)
    costs: dict[str, list[float]] = {key: [builder.compute_cost(key, s), 0.0] for key, s in solution.strategies.items()}
    for u, v, data in graph.edges(data=True):
        if not data["uses"] or u not in solution.placements:
            continue
        source = graph.nodes[u]
        for use in data["uses"]:
            required = required_placement(solution, v, use, solution.placements[u])
            produced = read_as(use, solution.placements[u])
            seconds = builder.redistribute(use.shape or source["shape"], _itemsize(source["dtype"]), produced, required)
            if use.kind is UseKind.INPUT:
                target = v
            elif use.kind is UseKind.OUTPUT:
                target = builder.resolve(u)[0]
            else:
                target = builder.resolve(v)[0]
            if target in costs:
                costs[target][1] += seconds * use.multiplier / max(graph.nodes[target]["multiplier"], 1)
    return {k: (c[0], c[1]) for k, c in costs.items()}

