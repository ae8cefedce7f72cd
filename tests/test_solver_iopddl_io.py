"""``write_iopddl``: the plain problems and the FX front's written in the contest's JSON format,
read back by ``read_iopddl`` as equal problems; the FX front's problem (class tables, tied
memory terms, a constant) so written has the same plans and optimum (against a brute force
over its choices); integer costs on request."""

import gzip
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import passes
from hops import Mesh
from passes.solver import peak_usage, problem_cost, read_iopddl, solve_problem, write_iopddl
from passes.solver.solve import Factor, MemoryTerm, placement_problem
from tests.helpers.random_problems import forbidden_as_1e18_problem
from tests.test_solver import SLOW_LINK, Choices, brute_force, random_factors


def assert_equal_problems(a, b):
    assert a.num_nodes == b.num_nodes and a.name == b.name and a.usage_limit == b.usage_limit
    for x, y in zip(a.node_costs, b.node_costs):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.node_usages, b.node_usages):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.intervals, b.intervals)
    np.testing.assert_array_equal(a.edges, b.edges)
    assert len(a.edge_costs) == len(b.edge_costs)
    for x, y in zip(a.edge_costs, b.edge_costs):
        np.testing.assert_array_equal(x, y)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    nodes=st.integers(1, 6),
    memory=st.booleans(),
    large=st.booleans(),
    gz=st.booleans(),
)
def test_a_plain_problem_reads_back_equal(tmp_path, seed, nodes, memory, large, gz):
    problem, _ = forbidden_as_1e18_problem(np.random.default_rng(seed), nodes, 4, 8, 0.3, 0.2, memory, large)
    # Fractional costs too: the FX front's are seconds.
    problem = type(problem)(
        tuple(c / 7.0 for c in problem.node_costs), problem.node_usages, problem.intervals, problem.edges,
        tuple(m / 3.0 for m in problem.edge_costs), problem.usage_limit, name=f"random-{seed}",
    )
    path = tmp_path / ("p.json.gz" if gz else "p.json")
    write_iopddl(problem, path)
    assert_equal_problems(read_iopddl(path), problem)


def fx_problem(rng, terms, budget):
    """The FX front's problem: class tables with forbidden pairs, a factor of a choice with
    itself, a constant; with ``terms`` several memory terms per choice (tied nodes), else every
    choice live at one time step."""
    costs = [rng.uniform(0, 5, size=n) for n in rng.integers(1, 4, size=5)]
    factors = random_factors(rng, costs, factors=7)
    c = int(rng.integers(len(costs)))
    n = len(costs[c])
    factors.append(Factor(c, c, np.arange(n), np.arange(n), rng.uniform(0, 1, size=(n, n))))
    if terms:
        memory = [
            MemoryTerm(int(k), int(start), int(start + rng.integers(1, 5)), rng.integers(0, 10, size=len(costs[k])).astype(float))
            for k, start in zip(rng.integers(0, len(costs), size=7), rng.integers(0, 8, size=7))
        ]
    else:
        memory = [MemoryTerm(i, 0, 1, rng.integers(0, 10, size=len(x)).astype(float)) for i, x in enumerate(costs)]
    choices = Choices(costs, factors, memory, budget)
    choices.problem = type(choices.problem)(
        choices.problem.node_costs, choices.problem.node_usages, choices.problem.intervals, choices.problem.edges,
        choices.problem.edge_costs, budget, name="fx", edge_classes=choices.problem.edge_classes,
        axes=choices.problem.axes, constant=1.25,
    )
    return choices


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("terms", [True, False])
def test_the_fx_front_written_has_its_plans_and_its_optimum(tmp_path, seed, terms):
    rng = np.random.default_rng(seed)
    budget = float(rng.integers(10, 30))
    fx = fx_problem(rng, terms, budget)
    path = tmp_path / "fx.json"
    write_iopddl(fx.problem, path)
    read = read_iopddl(path)
    assert read.num_nodes == fx.problem.num_nodes and read.usage_limit == budget and read.name == "fx"
    # Every plan is a plan of the written problem with the same cost and memory (the extra
    # nodes of further memory terms follow their choice's option).
    for _ in range(20):
        options = [int(rng.integers(len(c))) for c in fx.costs]
        full = options + [int(of[options[c]]) for c, of in fx.ties]
        assert problem_cost(read, full) == pytest.approx(fx.cost(options), rel=1e-12, abs=1e-12)
        assert peak_usage(read, full) == pytest.approx(fx.memory(options))
    expected, _ = brute_force(fx)
    if math.isinf(expected):
        with pytest.raises(passes.InfeasiblePlacementError):
            solve_problem(read)
        with pytest.raises(passes.InfeasiblePlacementError):
            solve_problem(fx.problem, dominance="equal")
        return
    assert solve_problem(read).cost == pytest.approx(expected, rel=1e-9)
    assert solve_problem(fx.problem, dominance="equal").cost == pytest.approx(expected, rel=1e-9)


def test_a_traced_programs_problem_is_written_with_integer_costs(tmp_path):
    gm = make_fx(lambda x, w1, w2: torch.relu(x @ w1) @ w2)(torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 2))
    graph = passes.placement_graph(gm, Mesh((2,), ("data",)))
    fx, _ = placement_problem(graph, SLOW_LINK)
    path = tmp_path / "matmul.json.gz"
    write_iopddl(fx, path, cost_scale=1e9)  # nanoseconds, as the contest's solvers read them
    with gzip.open(path, "rt") as f:
        data = json.load(f)["problem"]
    values = [v for c in data["nodes"]["costs"] for v in c] + [v for c in data["edges"]["costs"] for v in c]
    assert all(isinstance(v, int) for v in values)
    read = read_iopddl(path)
    expected, _ = brute_force(Choices.of(fx))
    assert solve_problem(read).cost == pytest.approx(expected * 1e9, rel=1e-6)


def test_bad_arguments_are_refused(tmp_path):
    problem, _ = forbidden_as_1e18_problem(np.random.default_rng(0), 2, 2, 1, 0.0, 0.0, False, False)
    with pytest.raises(TypeError, match="problem must be a StrategyProblem"):
        write_iopddl({"nodes": []}, tmp_path / "x.json")
    with pytest.raises(ValueError, match="cost_scale must be a finite number > 0"):
        write_iopddl(problem, tmp_path / "x.json", cost_scale=0)
