"""The solver on a model built on the meta device (nothing materialized), and on a 3-D mesh end
to end: solved, applied, variables constant in depth, lowered to DTensor on a fake process group
of 8 ranks (the collectives it issues are the ones the solution predicts)."""

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

import hops
import passes
from hops import Mesh, Partial, Replicate, Shard
from passes.solver import CostModel
from tests.helpers.snapshot import aot_trace

CUBE = Mesh((2, 2, 2), ("data", "fsdp", "tensor"))
GRID = Mesh((2, 2), ("data", "model"))
# Compute slow next to the links: the plan shards and redistributes at test sizes.
SLOW_COMPUTE = CostModel(peak_flops=1e9, memory_bandwidth=1e12, link_bandwidth=1e12, link_latency=0.0)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def layers(x, ws, w_out):
    """A stack of tanh layers run by a scan, then a projection and a mean square."""
    h, _ = hops.scan(lambda h, w: (torch.tanh(h @ w), None), x, ws)
    return (h @ w_out).square().mean()


def placeholders(gm):
    return list(gm.graph.find_nodes(op="placeholder"))


# --------------------------------------------------------------------------- the meta device


def test_a_model_on_the_meta_device_is_solved_and_applied_without_materializing_it():
    # 4 layers of 65536 x 65536 float32: 64 GiB of weights, more than this machine holds.
    dim = 2**16
    with torch.device("meta"):
        args = [torch.empty(16, dim), torch.empty(4, dim, dim, requires_grad=True), torch.empty(dim, 16, requires_grad=True)]
    assert sum(a.numel() * a.element_size() for a in args) > 64 * 2**30
    forward, backward, _ = aot_trace(layers, *args)
    solution = passes.solve_placements((forward, backward), GRID)
    passes.apply_placements((forward, backward), solution)
    passes.check_placements(forward)
    passes.check_placements(backward)
    assert solution.stats["status"] == "optimal"
    # Replicated weights would need 64 GiB + gradients + Adam state per device: the plan shards them.
    assert solution.placements["forward/primals_2"] != (Replicate(), Replicate())
    # Every value the solver and apply saw is a fake tensor of the meta device: none was made.
    for gm in (forward, backward):
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                assert isinstance(value, FakeTensor) and value.device.type == "meta", node.format_node()


def test_deleted_metadata_is_recomputed_from_meta_example_inputs():
    from tests.helpers.snapshot import delete_meta

    with torch.device("meta"):
        args = [torch.empty(8, 16), torch.empty(3, 16, 16, requires_grad=True), torch.empty(16, 4, requires_grad=True)]
    forward, backward, _ = aot_trace(layers, *args)
    expected = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_COMPUTE)
    for gm in (forward, backward):
        delete_meta(gm)
    with pytest.raises(passes.PassError, match="example_inputs"):
        passes.solve_placements((forward, backward), GRID, cost_model=SLOW_COMPUTE)
    solution = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_COMPUTE, example_inputs=args)
    assert solution.placements == expected.placements
    assert solution.cost == pytest.approx(expected.cost)


def test_the_example_traces_a_meta_model_as_fake_tensors_on_the_host():
    import auto_shard

    config = auto_shard.Config(layers=2)
    loss = auto_shard.make_loss(config, GRID)
    with torch.device("meta"):
        inputs = auto_shard.example_inputs(config)
    assert all(t.device.type == "meta" for t in (inputs[0], inputs[1], *inputs[2].values(), *inputs[3].values()))
    forward, backward = auto_shard.trace_training_step(loss, *inputs)
    # Traced as if on the CPU (the graphs' constants are made there), and never with real values.
    for node in placeholders(forward):
        assert isinstance(node.meta["val"], FakeTensor) and node.meta["val"].device.type == "cpu"
    # The same graphs as a trace of real inputs.
    real_forward, _ = auto_shard.trace_training_step(loss, *auto_shard.example_inputs(config))
    assert forward.code == real_forward.code


# --------------------------------------------------------------------------- a 3-D mesh


@pytest.fixture(scope="module")
def cube():
    """The layers model (6 layers) solved on the 2x2x2 mesh and applied; its inputs."""
    torch.manual_seed(0)
    args = [torch.randn(8, 16), torch.randn(6, 16, 16) / 4, torch.randn(16, 8) / 4]
    traced = aot_trace(layers, args[0], *(a.clone().requires_grad_() for a in args[1:]))
    forward, backward, _ = traced
    solution = passes.solve_placements((forward, backward), CUBE, cost_model=SLOW_COMPUTE)
    passes.apply_placements((forward, backward), solution)
    return dict(forward=forward, backward=backward, solution=solution, args=args)


def test_every_value_is_placed_on_all_three_axes(cube):
    solution = cube["solution"]
    assert solution.stats["status"] == "optimal"
    kinds = (Shard, Replicate, Partial)
    assert solution.placements and all(
        len(p) == 3 and all(isinstance(x, kinds) for x in p) for p in solution.placements.values()
    )
    # The plan uses the third axis: some value is laid out differently on it than replicated.
    assert any(not isinstance(p[2], Replicate) for p in solution.placements.values())
    # Applied: the annotations state 3-D layouts and check.
    passes.check_placements(cube["forward"])
    passes.check_placements(cube["backward"])
    stated = [
        node.args[1] for node in cube["forward"].graph.nodes if node.target is hops.sharding_annotation.sharding_annotation_hop
    ]
    assert stated and all(spec.mesh == CUBE and len(spec.placements) == 3 for spec in stated)


def test_variables_are_constant_in_depth_on_a_3d_mesh(cube):
    args = [torch.randn(8, 16), torch.randn(2, 16, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)]
    forward, backward, _ = aot_trace(layers, *args)
    shallow = passes.solve_placements((forward, backward), CUBE, cost_model=SLOW_COMPUTE)
    deep = cube["solution"]
    assert shallow.stats["variables"] == deep.stats["variables"]
    assert shallow.stats["constraints"] == deep.stats["constraints"]
    assert deep.cost > 2 * shallow.cost  # 6 layers against 2: the body's costs count per step


def test_the_3d_plan_runs_on_dtensor_and_issues_the_predicted_collectives(cube):
    """Lowered for a 2x2x2 DeviceMesh on a fake process group of 8 ranks: it runs, every
    gradient comes out laid out as its parameter was solved, and ``CommDebugMode`` counts the
    collectives ``solution.collectives`` predicts (a fake group moves no data, so values are not
    compared here; tests/test_dtensor.py runs real ranks)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import ones as dtensor_ones
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from passes.dtensor import collective_counts

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CUBE.size)
    try:
        device_mesh = CUBE.to_device_mesh()
        forward, backward, solution = cube["forward"], cube["backward"], cube["solution"]
        passes.lower_to_dtensor(forward, device_mesh)
        passes.lower_to_dtensor(backward, device_mesh)
        names = [node.name for node in placeholders(forward)]
        inputs = [
            distribute_tensor(a, device_mesh, [p.to_dtensor() for p in solution.placements[f"forward/{name}"]])
            for a, name in zip(cube["args"], names)
        ]
        with CommDebugMode() as forward_comms, torch.no_grad():
            loss, *saved = forward(*inputs)
        whole = [Replicate().to_dtensor()] * 3
        with CommDebugMode() as backward_comms, torch.no_grad():
            grads = backward(*saved, dtensor_ones((), device_mesh=device_mesh, placements=whole))
        for grad, name, arg in zip(grads[1:], names[1:], cube["args"][1:]):
            assert grad.shape == arg.shape
            assert tuple(grad.placements) == tuple(p.to_dtensor() for p in solution.placements[f"forward/{name}"])
        assert collective_counts(forward_comms) == solution.collectives("forward", device_type="cpu")
        assert collective_counts(backward_comms) == solution.collectives("backward", device_type="cpu")
    finally:
        dist.destroy_process_group()


def test_the_example_offers_the_region_one_layout_per_axis_of_the_heads_size():
    import auto_shard

    config = auto_shard.Config(batch=16, heads=8)
    S0, S2 = Shard(0), Shard(2)
    assert auto_shard.attention_placements(config, GRID) == [(S0, S2), (S2, S0)]
    assert auto_shard.attention_placements(config, Mesh((2, 2, 2), ("a", "b", "c"))) == [
        (S0, S0, S2), (S0, S2, S0), (S2, S0, S0)
    ]
    # A size-1 axis is not the heads' axis: the last axis of more than one device is.
    assert auto_shard.attention_placements(config, Mesh((2, 2, 1), ("a", "b", "c"))) == [(S0, S2, S0), (S2, S0, S0)]
    assert auto_shard.attention_placements(config, Mesh((4, 2), ("a", "b"))) == [(S0, S2)]
    with pytest.raises(ValueError, match="batch 16 and heads 8 split evenly over no layout"):
        auto_shard.attention_placements(config, Mesh((32, 2), ("a", "b")))
    assert auto_shard.parse_mesh("4x4x4") == Mesh((4, 4, 4), ("data", "fsdp", "tensor"))
    assert auto_shard.parse_mesh("2x2", "batch,model") == Mesh((2, 2), ("batch", "model"))
    with pytest.raises(ValueError, match="--mesh must be sizes joined by 'x'"):
        auto_shard.parse_mesh("2by2")


# --------------------------------------------------------------------------- redistributions


@pytest.fixture(scope="module")
def device_meshes():
    """DeviceMeshes of 8 ranks shaped (8,), (2, 4) and (2, 2, 2) on a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        meshes = [Mesh((8,), ("a",)), Mesh((2, 4), ("a", "b")), CUBE]
        yield {mesh: mesh.to_device_mesh() for mesh in meshes}
    finally:
        dist.destroy_process_group()


def test_redistribution_steps_are_the_ones_dtensor_plans(device_meshes):
    """On meshes of rank 1 to 3, for any two layouts of a rank-3 tensor, the steps the cost model
    prices and the collectives it predicts are DTensor's own plan, step for step."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from passes.solver import _dtensor
    from passes.solver.collectives import redistribution_collectives
    from passes.solver.cost import redistribution_steps

    source_options = [Replicate(), Shard(0), Shard(1), Shard(2), Partial()]
    target_options = [Replicate(), Shard(0), Shard(1), Shard(2)]
    shape = (8, 8, 8)
    meta = _dtensor.tensor_meta(shape, torch.float32)

    @settings(max_examples=150, deadline=None)
    @given(st.sampled_from(sorted(device_meshes, key=lambda m: m.ndim)), st.data())
    def check(mesh, data):
        source = tuple(data.draw(st.sampled_from(source_options)) for _ in mesh.shape)
        target = tuple(data.draw(st.sampled_from(target_options)) for _ in mesh.shape)
        device_mesh = device_meshes[mesh]
        infos = _gen_transform_infos(
            DTensorSpec(device_mesh, _dtensor.to_dtensor(source), tensor_meta=meta),
            DTensorSpec(device_mesh, _dtensor.to_dtensor(target), tensor_meta=meta),
        )
        planned = [
            (info.mesh_dim, *(_dtensor.from_dtensor((p,), len(shape))[0] for p in info.src_dst_placements))
            for info in infos
        ]
        # torch 2.9 lists the one axis of a 1-D mesh even when it does not change.
        planned = [step for step in planned if step[1] != step[2]]
        assert redistribution_steps(source, target) == planned, (mesh, source, target)
        communicating = [(a, b) for _, a, b in planned if not isinstance(a, Replicate)]
        assert len(redistribution_collectives(source, target, mesh)) == len(communicating)

    check()


# --------------------------------------------------------------------------- production-size formulation


def test_redistribution_tables_equal_the_per_pair_cost():
    """``redistribute_terms_table`` (every pair at once, as the solver builds its tables) is
    ``redistribute_seconds`` pair by pair: any mesh of rank 1 to 3 (size-1 axes too), per-axis
    links, any layouts with shards, sums and other partial reductions, and non-tensors."""
    import itertools

    from hypothesis import given, settings
    from hypothesis import strategies as st

    per_axis = [Replicate(), Shard(0), Shard(1), Shard(2), Partial(), Partial("max")]

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3), st.data())
    def check(sizes, data):
        mesh = Mesh(tuple(sizes), tuple("abc"[: len(sizes)]))
        model = CostModel(
            peak_flops=1e12, memory_bandwidth=data.draw(st.floats(1e9, 1e12)),
            link_bandwidth=tuple(data.draw(st.floats(1e8, 1e11)) for _ in sizes),
            link_latency=tuple(data.draw(st.floats(0, 1e-4)) for _ in sizes),
        )
        every = list(itertools.product(per_axis, repeat=mesh.ndim))
        sources = data.draw(st.lists(st.sampled_from(every + [None]), min_size=1, max_size=12))
        targets = data.draw(st.lists(st.sampled_from(every + [None]), min_size=1, max_size=12))
        shape, itemsize = (12, 8, 6), 2
        fixed, per_byte = model.redistribute_terms_table(sources, targets, mesh)
        for i, p in enumerate(sources):
            for j, q in enumerate(targets):
                expected = model.redistribute_seconds(shape, itemsize, p, q, mesh)
                assert fixed[i, j] + per_byte[i, j] * 12 * 8 * 6 * itemsize == pytest.approx(expected, rel=1e-12, abs=0), (p, q)

    check()


@pytest.fixture(scope="module")
def small_decoder_on_a_cube():
    """The example's decoder (2 layers, dims that split over at most two axes of 2) traced for the
    2x2x2 mesh, and its placement graph."""
    import auto_shard

    config = auto_shard.Config(layers=2, batch=4, heads=2, kv_heads=1, dim=4, ffn=6, vocab=5, seq=3)
    with torch.device("meta"):
        inputs = auto_shard.example_inputs(config)
    graphs = auto_shard.trace_training_step(auto_shard.make_loss(config, CUBE), *inputs)
    return graphs, passes.placement_graph(graphs, CUBE)


def test_the_axis_search_finds_the_exact_optimum_of_a_small_decoder_on_a_cube(small_decoder_on_a_cube):
    """``search="axes"`` (the formulation production 3-D meshes get) against one exact integer
    program over every layout, on the same graph and cost model: the same optimum (stated
    tolerance: a relative 1e-9, the solvers' gap), with a fraction of the variables; the plan
    is applied and checks."""
    from passes.solver.solve import solve_graph

    graphs, graph = small_decoder_on_a_cube
    exact = solve_graph(graph, cost_model=SLOW_COMPUTE, search="exact")
    searched = solve_graph(graph, cost_model=SLOW_COMPUTE, search="axes")
    assert exact.stats["search"] == "exact" and exact.stats["status"] == "optimal"
    assert searched.stats["search"] == "axes" and "not proven optimal" in searched.stats["status"]
    assert searched.cost == pytest.approx(exact.cost, rel=1e-9)
    assert searched.stats["variables"] * 5 < exact.stats["variables"]
    passes.apply_placements(graphs, searched)
    for gm in graphs:
        passes.check_placements(gm)
    # And DTensor's lowering takes it (a fake process group of 8 ranks: nothing runs).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    started = not dist.is_initialized()  # the module's 8-rank fake group may still be up
    if started:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CUBE.size)
    try:
        assert dist.get_world_size() >= CUBE.size
        device_mesh = CUBE.to_device_mesh()
        for gm in graphs:
            passes.lower_to_dtensor(gm, device_mesh)
    finally:
        if started:
            dist.destroy_process_group()


def test_search_is_checked():
    from passes.solver import StrategyProblem, solve_problem

    problem = StrategyProblem((np.zeros(2),), (np.zeros(2),), [(0, 0)], [], ())
    with pytest.raises(ValueError, match="search must be one of"):
        solve_problem(problem, search="fast")


def _random_axis_problem(seed: int, budgeted: bool):
    """A random problem whose options are every per-axis layout on 3 axes (2 per axis), four
    choices all live together, each with 3 neighbours (none is eliminated); the budget (if
    ``budgeted``) at the median peak. (problem, its brute-force optimum)."""
    import itertools

    from passes.solver.solve import Factor, MemoryTerm, choice_problem

    layouts = np.array(list(itertools.product(range(2), repeat=3)))  # 8 options, a code per axis
    rng = np.random.default_rng(seed)
    costs = [rng.uniform(0, 3, 8) for _ in range(4)]
    terms = [MemoryTerm(i, 0, 1, rng.integers(0, 5, 8).astype(float)) for i in range(4)]
    factors = []
    for a, b in itertools.combinations(range(4), 2):
        table = rng.uniform(0, 3, (8, 8))
        table[rng.uniform(size=(8, 8)) < 0.2] = np.inf
        np.fill_diagonal(table, 0.0)  # equal layouts: nothing to move
        factors.append(Factor(a, b, np.arange(8), np.arange(8), table))
    problem, _ = choice_problem(costs, factors, terms, None, [layouts] * 4)
    # Every plan's cost and peak from the raw arrays, at once.
    plans = np.array(list(itertools.product(range(8), repeat=4)))
    totals = sum(costs[i][plans[:, i]] for i in range(4))
    totals = totals + sum(f.table[plans[:, f.a], plans[:, f.b]] for f in factors)
    peaks = sum(t.usage[plans[:, t.choice]] for t in terms)
    budget = float(np.median(peaks)) if budgeted else None
    problem = problem.with_usage_limit(budget)
    optimum = float(totals[peaks <= budget + 1e-9].min() if budget is not None else totals.min())
    return problem, optimum


def _check_axis_plan(problem, searched, optimum) -> None:
    from passes.solver import peak_usage, problem_cost

    assert searched.stats["search"] == "axes"
    assert np.isfinite(searched.cost) and searched.cost == pytest.approx(problem_cost(problem, searched.strategies))
    assert searched.cost >= optimum - 1e-9
    if problem.usage_limit is not None:
        assert peak_usage(problem, searched.strategies) <= problem.usage_limit + 1e-9


def test_the_axis_search_returns_a_valid_plan_no_better_than_the_optimum_and_within_the_budget():
    """Random problems on 3 mesh axes: the search's plan has finite cost, fits the budget,
    costs what ``evaluate`` says, and is never below the brute-force optimum (which the exact
    program meets)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from passes.solver import solve_problem

    @settings(max_examples=25, deadline=None)
    @given(st.integers(0, 2**32 - 1), st.booleans())
    def check(seed, budgeted):
        problem, optimum = _random_axis_problem(seed, budgeted)
        exact = solve_problem(problem, search="exact", dominance="equal")
        assert exact.cost == pytest.approx(optimum, rel=1e-9)
        _check_axis_plan(problem, solve_problem(problem, search="axes", dominance="equal"), optimum)

    check()


def test_the_axis_search_refines_the_heuristics_plan_when_its_coarse_level_gets_no_time(monkeypatch):
    """With a time limit the mesh-axis policy starts from the heuristics' plan: where its coarse
    program does not finish (here: given no time), the neighbourhoods refine that plan and the
    call still answers with a valid one (before, it raised ``NoPlanFoundError``: a 478-node
    decoder on a 2x2x2 mesh at a 3 s limit)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import passes.solver.search as search_module
    from passes.solver import solve_problem

    monkeypatch.setattr(search_module, "_COARSE_SHARE", 0.0)

    @settings(max_examples=8, deadline=None)
    @given(st.integers(0, 2**32 - 1), st.booleans())
    def check(seed, budgeted):
        problem, optimum = _random_axis_problem(seed, budgeted)
        searched = solve_problem(problem, search="axes", dominance="equal", time_limit=20)
        _check_axis_plan(problem, searched, optimum)
        assert searched.stats["coarse_costs"] == []  # (the coarse level did not run)

    check()
