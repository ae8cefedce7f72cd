"""A scan's plan, solved once for its body, costs what the unrolled program's best plan costs.

The program is ``examples/auto_shard.py``'s decoder (small dims) on an 8x8 fake mesh with the
``h100`` cost model, traced twice: as a scan over stacked layer weights, and as the Python loop
over the layers (``make_loss(..., unrolled=True)``), each solved as its own program.

How the scan plan's cost is measured: the scan plan (one strategy per body value, for every
step) is evaluated with ``evaluate_placements`` on the scan program unrolled per step
(``passes.solver.unrolled``: one copy of the body per step, each read priced under the same
``CostModel`` as the loop's), which is the scan solver's own objective (asserted equal). That is
compared with the loop program's optimum under the same ``CostModel``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import pytest
import torch

import hops
import passes
from passes.solver import CostModel
from passes.solver.cost import _is_allocation
from passes.solver.graph import NodeKind, arrives_whole, is_view
from passes.solver.solve import evaluate_placements, solve_graph
from passes.solver.unrolled import scan_plan_on_unrolled, unrolled_graph

MESH = hops.Mesh((8, 8), ("data", "model"))
COST_MODEL = CostModel.preset("h100")
SMALL = dict(dim=128, heads=8, kv_heads=2, vocab=512, ffn=384, batch=8, seq=256)


def load_example():
    """examples/auto_shard.py, imported by name (the examples are scripts, not a package)."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    return importlib.import_module("auto_shard")


@functools.lru_cache(maxsize=None)
def solved(layers: int, unrolled: bool):
    """The optimum of the scan (or loop) program of ``layers`` layers, solved once per test run."""
    example = load_example()
    cfg = example.Config(layers=layers, **SMALL)
    with torch.device("meta"):
        inputs = example.example_inputs(cfg)  # shapes only
    graphs = example.trace_training_step(example.make_loss(cfg, MESH, unrolled=unrolled), *inputs)
    return solve_graph(passes.placement_graph(graphs, MESH), cost_model=COST_MODEL)


def scan_plan_cost(solution) -> float:
    """The scan plan's seconds on the scan program unrolled per step, under the same cost model."""
    unrolled, origin = unrolled_graph(solution.graph)
    return evaluate_placements(unrolled, scan_plan_on_unrolled(unrolled, origin, solution), COST_MODEL)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_scan_plan_costs_within_2_percent_of_the_unrolled_programs_optimum(layers):
    scan = solved(layers, unrolled=False)
    loop = solved(layers, unrolled=True)
    measured = scan_plan_cost(scan)
    # The scan's objective is what its plan costs when every step is priced on its own.
    assert measured == pytest.approx(scan.cost, rel=1e-9)
    ratio = measured / loop.cost
    assert ratio <= 1.02, (
        f"N={layers}: scan plan {measured * 1e3:.5f} ms vs the unrolled program's optimum "
        f"{loop.cost * 1e3:.5f} ms: ratio {ratio:.4f}"
    )


def test_the_scan_problem_does_not_grow_with_depth():
    assert solved(1, False).stats["variables"] == solved(2, False).stats["variables"]


def test_values_that_left_their_graph_arrive_without_a_pending_sum():
    # Saved forward values the backward reads and a scan's final carry were reduced on leaving
    # their graph: their placements hold no Partial, so no read of them pays that sum again.
    for layers in (1, 2):
        solution = solved(layers, unrolled=False)
        whole = [k for k in solution.placements if arrives_whole(solution.graph, k)]
        assert any(k.startswith("backward/") and solution.graph.nodes[k]["fx_node"].op == "placeholder" for k in whole)
        assert all(solution.graph.nodes[k]["kind"] is NodeKind.ALIAS for k in whole)
        for key in whole:
            assert not any(isinstance(p, hops.Partial) for p in solution.placements[key]), key


def test_functional_view_copies_and_allocations_are_free():
    # Functionalization writes a region body's views inside a scan as ``*_copy`` ops; a compiler
    # lowers them as the views they are. An allocation reads and writes nothing.
    aten = torch.ops.aten
    for op in (aten.view_copy.default, aten.transpose_copy.int, aten.expand_copy.default, aten.view.default):
        assert is_view(op)
        assert COST_MODEL.compute_seconds(op, [(64, 64)], [(64, 64)], 4) == 0.0
    for op in (aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default):
        assert _is_allocation(op)
        assert COST_MODEL.compute_seconds(op, [(64, 64)], [(64, 64)], 4) == 0.0
    for op in (aten.clone.default, aten.copy.default, aten.fill.Scalar):
        assert not is_view(op) and not _is_allocation(op)
        assert COST_MODEL.compute_seconds(op, [(64, 64)], [(64, 64)], 4) > 0.0


def rnn_step(h, w):
    h = torch.tanh(h @ w)
    return h, h.sum(-1)


def test_a_scan_plan_costs_its_objective_when_every_step_is_priced_on_its_own():
    # The class behind the gap: the scan formulation must price what running its plan step by
    # step costs (entry, carries between steps, stacked xs and ys once, pending sums). Property:
    # for any length and direction, the plan evaluated on the scan unrolled per step costs the
    # scan's objective, and per-step freedom does no worse.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.helpers.snapshot import aot_trace

    grid = hops.Mesh((2, 2), ("data", "model"))
    models = [
        CostModel(peak_flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e8, link_latency=1e-6),
        CostModel.preset("h100"),
    ]

    @settings(max_examples=4, deadline=None)
    @given(st.sampled_from([1, 2, 3, 5]), st.booleans(), st.sampled_from(models))
    def check(length, reverse, cost_model):
        def loss(h, ws):
            last, ys = hops.scan(rnn_step, h, ws, reverse=reverse)
            return last.sum() + ys.square().sum()

        forward, backward, _ = aot_trace(loss, torch.randn(8, 16), torch.randn(length, 16, 16, requires_grad=True))
        solution = passes.solve_placements((forward, backward), grid, cost_model=cost_model)
        unrolled, origin = unrolled_graph(solution.graph)
        measured = evaluate_placements(unrolled, scan_plan_on_unrolled(unrolled, origin, solution), cost_model)
        assert measured == pytest.approx(solution.cost, rel=1e-9)
        assert solve_graph(unrolled, cost_model=cost_model).cost <= measured * (1 + 1e-9)

    check()
