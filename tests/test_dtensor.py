"""Target ``"dtensor"`` (``passes.lower_to_dtensor``) on real processes.

Four worker processes (gloo on loopback) are spawned once for this module and run every
scenario of ``tests/helpers/dtensor_scenarios.py``; each test asserts one scenario's result on every
rank: its numbers equal single-device eager (checked in the worker), its collectives
(``CommDebugMode``) are exactly those the placements call for (for solved plans: those the
solution predicts), its gradients have the layouts the specs state. The examples are traced
and solved once, in this process, while the workers run the other scenarios. Lowering-time
errors are tested in this process on a fake process group.
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec, _compat
from passes.solver.collectives import redistribution_collectives
from tests.helpers.snapshot import aot_trace, delete_meta

dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available in this torch build")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

WORLD_SIZE = 4
TIMEOUT_SECONDS = 240
HERE = os.path.dirname(os.path.abspath(__file__))
MESH = Mesh.of(data=2, model=2)
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's per-scenario results (spawned once; killed after ``TIMEOUT_SECONDS``).

    While the ranks run the first scenarios, this process makes the examples' plans (tracing,
    solving) once for all of them (``dtensor_scenarios.write_plans``)."""
    from tests.helpers import dtensor_scenarios
    from tests.helpers.ranks import run_ranks

    outdir = tmp_path_factory.mktemp("dtensor")
    return run_ranks(
        os.path.join(HERE, "helpers", "dtensor_scenarios.py"), [], outdir, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS,
        extra_env={dtensor_scenarios.PLANS_ENV: str(outdir)}, while_running=lambda: dtensor_scenarios.write_plans(str(outdir)),
    )


def scenario(results, name):
    """The scenario's report on rank 0, after checking that it ran without error on every rank
    and reported the same on every rank (skipped where this torch's DTensor cannot run it)."""
    from tests.helpers import dtensor_scenarios

    if name in dtensor_scenarios.UNSUPPORTED:
        pytest.skip(dtensor_scenarios.UNSUPPORTED[name])
    reports = []
    for rank, outcome in enumerate(results):
        report = outcome["results"].get(name)
        assert report is not None, f"rank {rank} did not finish scenario {name} (exit code {outcome['code']}):\n{outcome['log']}"
        assert report["error"] is None, f"rank {rank}, scenario {name}:\n{report['error']}"
        reports.append({k: v for k, v in report.items() if k != "seconds"})
    for rank, report in enumerate(reports[1:], start=1):
        assert report == reports[0], f"scenario {name}: rank {rank} reports {report}, rank 0 {reports[0]}"
    return reports[0]


def test_the_workers_never_bring_up_torch_xla(results):
    assert scenario(results, "process")["torch_xla_imported"] is False


R, S0, S1, P = "Replicate()", "Shard(dim=0)", "Shard(dim=1)", "Partial(sum)"


# --------------------------------------------------------------------------- annotations


def test_an_annotation_that_keeps_the_layout_issues_no_collective(results):
    report = scenario(results, "annotation_keeping_the_layout")
    assert report["comms"] == {}
    assert report["placements"] == [S0, R]


def test_shard_to_replicate_is_one_all_gather(results):
    report = scenario(results, "annotation_shard_to_replicate")
    assert report["comms"] == {"all_gather": 1}
    assert report["placements"] == [R, R]


def test_a_partial_value_is_reduced_where_the_annotation_says(results):
    # Partial on both axes -> Shard(0) on "data" (reduce-scatter), Replicate on "model" (all-reduce).
    report = scenario(results, "annotation_of_a_partial_value")
    assert report["comms"] == {"reduce_scatter": 1, "all_reduce": 1}
    assert report["placements"] == [S0, R]


def test_a_forward_graph_under_autograd_lays_the_gradient_out_per_grad_spec(results):
    report = scenario(results, "annotation_gradient_layout_under_autograd")
    assert report["placements"] == [S0, R]
    assert report["grad_placements"] == [R, R]
    assert report["comms"] == {"all_gather": 1}  # the Shard(0) cotangent gathered to Replicate


def test_the_aot_backward_graph_holds_the_transposed_annotation(results):
    report = scenario(results, "annotation_in_aot_backward_graph")
    assert report["backward_specs"] == ["hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(1)R', 'S(0)R')"]
    assert report["grad_placements"] == [[S1, R]]
    assert report["forward_comms"] == {}  # Replicate -> Shard(0) is local
    # The gradient reaches the annotation as Shard(0) and leaves as Shard(1): an all-to-all,
    # which DTensor runs as one all-gather (then a local chunk) on gloo; the solver counts it so.
    predicted = redistribution_collectives(ROWS.placements, (Shard(1), Replicate()), MESH, device_type="cpu")
    assert report["backward_comms"] == dict(Counter(predicted)) == {"all_gather": 1}


# --------------------------------------------------------------------------- local_map


def test_a_replicated_weight_gets_a_partial_gradient_autoparallel_515(results):
    report = scenario(results, "region_replicated_weight_gets_a_partial_gradient")
    for placements in (report["grad_placements"], report["autograd_grad_placements"]):
        assert placements == [[S0, R], [P, R]]
    assert report["forward_comms"] == report["backward_comms"] == report["autograd_comms"] == {}


def test_a_replicated_output_takes_a_pending_sum_cotangent_by_default(results):
    report = scenario(results, "region_replicated_output_pending_sum_cotangent")
    assert report["grad_placements"] == [[P, P]]
    assert report["forward_comms"] == report["backward_comms"] == {}


def test_given_in_grad_placements_take_whole_cotangents(results):
    report = scenario(results, "region_replicated_output_whole_cotangent")
    assert report["grad_placements"] == [[R, R]]
    assert report["forward_comms"] == report["backward_comms"] == {}


def test_a_kernel_runs_on_local_shards_inside_a_region(results):
    report = scenario(results, "kernel_in_a_region")
    assert report["grad_placements"] == [[S0, P], [P, P]]
    assert report["forward_comms"] == report["backward_comms"] == {}


def test_each_region_alternative_runs_its_own_body_on_its_local_shards(results):
    report = scenario(results, "region_alternatives_with_other_local_shapes")
    assert report["alternative 0"] == {"out": [R, S0], "grads": [[P, S0], [P, P]]}
    assert report["alternative 1"] == {"out": [R, S1], "grads": [[P, P], [P, S1]]}


# --------------------------------------------------------------------------- scan, scopes


def test_a_scan_runs_as_a_loop_of_dtensor_steps(results):
    report = scenario(results, "scan_with_an_annotated_body")  # its numbers equal eager on every rank
    if not _compat.DTENSOR_ADDS_REPLICATE_TO_PARTIAL_LOCALLY:
        pytest.skip(
            "the weight's gradient summed over steps stays Partial only where DTensor adds Replicate and "
            "Partial locally (torch >= 2.13); before, each step all-reduces it"
        )
    assert report["grad_placements"] == [[S0, R], [S1, R], [P, R]]
    assert report["forward_comms"] == report["backward_comms"] == {}


def test_a_named_scope_is_inlined_or_recorded(results):
    report = scenario(results, "named_scope_inlined_and_recorded")
    assert report["inlined_code_mentions_scope"] is False
    assert report["recorded_events"] == ["block"]


# --------------------------------------------------------------------------- ops without a DTensor rule

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def test_an_op_without_a_dtensor_rule_runs_on_gathered_inputs_under_autograd(results):
    report = scenario(results, "op_without_a_rule_under_autograd")  # its numbers equal eager on every rank
    assert report["comms"] == {"all_gather": 1}  # the rows gathered; the gradient's rows kept locally
    assert report["placements"] == [R, R]
    assert report["grad_placements"] == [S0, R]


def test_tensor_constants_and_factory_ops_run_as_replicated_dtensors(results):
    report = scenario(results, "constants_and_factory_ops")  # its numbers equal eager on every rank
    assert report["placements"] == [S0, R]


def test_checks_without_a_rule_hold_of_the_global_value(results):
    # torch.export's _assert_tensor_metadata and _assert_async on a row-sharded DTensor: the
    # global size passes (the local [4, 4] would fail), a wrong size and a false bound raise
    # (checked on every rank). The one collective is the program's own: its amax's pending
    # maximum reduced; the checked tensor is never gathered.
    report = scenario(results, "checks_without_a_rule")
    assert report["comms"] == {"all_reduce": 1}


def test_ops_dtensor_mistakes_run_right(results):
    # fill.Scalar, and embedding backwards differing only in the vocabulary's size: loss and
    # gradients equal eager on every rank (DTensor 2.9 raises for the first and gives the second
    # backward the first's global shape: the lowering runs the first by fill_'s rule and
    # declares the size part of DTensor's cache key there); and a traced LayerNorm backward
    # with its weight and bias sharded (DTensor 2.9 runs its kernel on their shards: the
    # lowering replicates them first).
    scenario(results, "ops_dtensor_runs_only_by_the_lowering")


def aten_checks_without_a_rule() -> list:
    """Every ATen op that takes tensors, returns nothing, writes nothing and has no DTensor
    strategy: assertions such as torch.export's ``_assert_tensor_metadata``."""
    from passes.solver._dtensor import rule_of

    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            schema = op._schema
            if (
                not schema.returns
                and not schema.is_mutable
                and any("Tensor" in str(a.type) for a in schema.arguments)
                and rule_of(op) is None
            ):
                found.append(op)
    return found


def test_every_aten_check_without_a_rule_is_lowered(fake_mesh):
    """Generated over the class: each such op in a graph computing on DTensors becomes
    ``check_on_dtensors`` (DTensor would raise ``NotImplementedError`` for it); ops that answer
    with metadata DTensor computes itself (``sym_size``) are left to DTensor."""
    from passes.dtensor.runtime import check_on_dtensors

    checks = aten_checks_without_a_rule()
    assert torch.ops.aten._assert_tensor_metadata.default in checks
    for op in checks + [torch.ops.aten.sym_size.int]:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        node = graph.call_function(op, (x,))
        graph.output(x)
        gm = passes.lower_to_dtensor(torch.fx.GraphModule(torch.nn.Module(), graph), fake_mesh)
        (lowered,) = [n for n in gm.graph.nodes if n.op == "call_function"]
        if op in checks:
            assert lowered.target is check_on_dtensors and lowered.args[0] is op, (op, gm.code)
        else:
            assert lowered.target is op, gm.code
        assert lowered.name == node.name


@pytest.mark.parametrize("name", ["replicated_attention", "solved_attention"])
def test_sdpa_attention_runs_replicated_forward_and_backward(results, name):
    # Causal SDPA on CPU, which DTensor has no strategy for; the loss and every gradient equal
    # single-device eager on every rank (checked there).
    report = scenario(results, name)
    assert set(report["run_replicated"]["forward"]) == {SDPA}
    assert SDPA_BACKWARD in report["run_replicated"]["backward"]


def test_an_op_without_a_rule_sees_its_gathered_inputs_laid_out_as_traced(results):
    # Issue 32: heads sharded, SDPA's inputs gathered contiguous, its CPU gradients laid out as
    # those; the backward's traced `view` of them raised "Cannot view a tensor". Loss and every
    # gradient equal single-device eager on every rank (checked there).
    report = scenario(results, "attention_with_sharded_heads")
    assert SDPA_BACKWARD in report["run_replicated"]["backward"]


def test_the_lowering_runs_replicated_what_the_solver_priced_so(results):
    report = scenario(results, "solved_attention")
    lowered = Counter(report["run_replicated"]["forward"] + report["run_replicated"]["backward"])
    assert dict(lowered) == report["unsupported_ops"]
    # Gathered where the plan gathers: DTensor issues the collectives the solution predicts.
    assert report["forward_comms"] == report["predicted"]["forward"]
    assert report["backward_comms"] == report["predicted"]["backward"]
    assert sum(report["forward_comms"].values()) > 0


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("example", ["sharded_mlp", "local_map_attention", "scan_layers", "auto_shard"])
def test_example_matches_single_device_eager(results, example):
    report = scenario(results, f"example_{example}")
    assert set(report["forward_comms"]) <= {"all_gather", "all_reduce", "reduce_scatter", "all_to_all"}


def test_sharded_mlp_collectives(results):
    # Forward: the Partial product of the down projection reduced once (S(0)S(1) @ R -> S(0)P -> S(0)R).
    report = scenario(results, "example_sharded_mlp")
    assert report["forward_comms"] == {"all_reduce": 1}


# --------------------------------------------------------------------------- the solver's prediction


@pytest.mark.parametrize("name", ["solved_mlp", "example_auto_shard"])
def test_the_solver_predicts_the_collectives_dtensor_issues(results, name):
    # Solved (MLP: for slow compute and free links; the decoder: a TPU v5e-like model), applied,
    # lowered, run on 4 ranks: CommDebugMode counts what PlacementSolution.collectives() said,
    # per graph and kind.
    report = scenario(results, name)
    assert report["forward_comms"] == report["predicted"]["forward"]
    assert report["backward_comms"] == report["predicted"]["backward"]


@pytest.mark.parametrize("name", ["solved_mlp", "example_auto_shard"])
def test_the_solved_plans_communicate(results, name):
    # The comparison above means something only where the plans redistribute, in more than one way.
    report = scenario(results, name)
    assert sum(report["forward_comms"].values()) > 0 and sum(report["backward_comms"].values()) > 0
    assert len(set(report["forward_comms"]) | set(report["backward_comms"])) >= 2


# --------------------------------------------------------------------------- in this process


@pytest.fixture(scope="module")
def fake_mesh():
    """A 2x2 DeviceMesh on a fake process group of 4 ranks (lowering issues no collective)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield MESH.to_device_mesh()
    finally:
        dist.destroy_process_group()


@hops.kernel(abstract=lambda x: torch.empty_like(x))
def doubled(x):
    return x * 2


def test_every_hop_has_a_dtensor_rule():
    from tests.test_targets import package_hops

    for hop in package_hops():
        assert passes.rule_for("dtensor", hop) is not None, hop.__name__


def test_a_kernel_outside_a_region_is_refused_naming_it(fake_mesh):
    gm = make_fx(lambda x: doubled(x) + 1, tracing_mode="fake")(torch.randn(4, 4))
    with pytest.raises(passes.PassError, match=r"hops_kernel_doubled.*kernel 'hops_kernel_doubled' is called on DTensors.*local_map"):
        passes.lower_to_dtensor(gm, fake_mesh)


def annotating(spec):
    return lambda x: hops.annotate_sharding(x, spec)


def test_a_mesh_that_is_not_the_device_mesh_is_refused_naming_the_node(fake_mesh):
    for mesh, why in (
        (Mesh.of(data=4, model=1), r"shape \(4, 1\) vs \(2, 2\)"),
        (Mesh.of(batch=2, model=2), r"axis names \('batch', 'model'\) vs \('data', 'model'\)"),
        (Mesh.of((3, 2, 1, 0), data=2, model=2), r"ranks \(3, 2, 1, 0\) vs \(0, 1, 2, 3\)"),
    ):
        spec = ShardingSpec(mesh, (Shard(0), Replicate()))
        gm = make_fx(annotating(spec), tracing_mode="fake")(torch.randn(4, 4))
        with pytest.raises(passes.PassError, match=rf"lower_to_dtensor: %hops_sharding_annotation.*does not match the DeviceMesh.*{why}"):
            passes.lower_to_dtensor(gm, fake_mesh)
        region = hops.local_map(lambda x: x * 2, mesh=mesh, in_placements=((Shard(0), Replicate()),), out_placements=(Shard(0), Replicate()))
        gm = make_fx(region, tracing_mode="fake")(torch.randn(4, 4))
        with pytest.raises(passes.PassError, match=rf"lower_to_dtensor: %hops_local_map.*{why}"):
            passes.lower_to_dtensor(gm, fake_mesh)


def test_a_hops_mesh_needs_a_process_group_of_its_size(fake_mesh):
    gm = make_fx(lambda x: hops.annotate_sharding(x, ROWS), tracing_mode="fake")(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"lower_to_dtensor\(device_mesh=hops.Mesh.of\(data=4, model=2\)\).*world size 4"):
        passes.lower_to_dtensor(gm, Mesh.of(data=4, model=2))
    with pytest.raises(TypeError, match=r"device_mesh=...\) must be a torch.distributed DeviceMesh or a hops.Mesh, got str"):
        passes.lower_to_dtensor(gm, "cpu")


def test_a_region_inside_a_region_body_is_refused(fake_mesh):
    inner = hops.local_map(lambda x: x * 2, mesh=MESH, in_placements=((Replicate(), Replicate()),), out_placements=(Replicate(), Replicate()))
    outer = hops.local_map(inner, mesh=MESH, in_placements=(ROWS.placements,), out_placements=ROWS.placements)
    gm = make_fx(outer, tracing_mode="fake")(torch.randn(4, 4))
    with pytest.raises(passes.PassError, match=r"hops_local_map.*a local_map region inside a region body"):
        passes.lower_to_dtensor(gm, fake_mesh)


def test_format_placements_names_the_ops_the_lowering_runs_replicated(fake_mesh):
    from passes.dtensor.runtime import run_replicated
    from tests.helpers.dtensor_scenarios import causal_attention

    args = [torch.randn(2, 8, 16)] + [torch.randn(16, 16) / 4 for _ in range(4)]
    forward, backward, _ = aot_trace(causal_attention, *(a.requires_grad_() for a in args))
    solution = passes.solve_placements((forward, backward), MESH)
    said, graph = [], None
    for line in passes.format_placements((forward, backward), solution).splitlines():
        if line.endswith(":") and not line.startswith(" "):
            graph = line[:-1]
        elif "no DTensor rule: run replicated (inputs gathered, the op on local tensors)" in line:
            said.append(f"{graph}/{line.split(' = ')[0].strip()}")
    passes.lower_to_dtensor(forward, fake_mesh)
    passes.lower_to_dtensor(backward, fake_mesh)
    wrapped = [
        f"{graph}/{node.name}"
        for graph, gm in (("forward", forward), ("backward", backward))
        for node in gm.graph.nodes
        if node.target is run_replicated
    ]
    assert said and sorted(said) == sorted(wrapped)
    assert sum(solution.stats["unsupported_ops"].values()) == len(wrapped)


def test_an_in_place_op_without_a_dtensor_rule_is_refused_naming_it(fake_mesh):
    # Run on gathered copies, it would leave its DTensor input as it was.
    library = torch.library.Library("hops_dtensor_test", "FRAGMENT")
    library.define("bump_(Tensor(a!) x) -> Tensor(a!)")
    library.impl("bump_", lambda x: x.add_(1), "CompositeExplicitAutograd")
    library.impl("bump_", lambda x: x, "Meta")
    gm = make_fx(lambda x: torch.ops.hops_dtensor_test.bump_(x * 2), tracing_mode="fake")(torch.randn(4, 4))
    with pytest.raises(passes.PassError, match=r"%bump_.*no sharding strategy for the in-place op hops_dtensor_test.bump_.default"):
        passes.lower_to_dtensor(gm, fake_mesh)


def test_lowering_without_meta_gives_the_same_code(fake_mesh):
    from tests.helpers.hop_db import SAMPLES

    for sample in SAMPLES:
        inputs = [t.requires_grad_() if t.is_floating_point() else t for t in sample.inputs(0)]
        forward, backward, _ = aot_trace(sample.program, *inputs)
        for gm in (make_fx(sample.program, tracing_mode="fake")(*sample.inputs(0)), forward, backward):
            outcomes = []
            for graph in (copy.deepcopy(gm), copy.deepcopy(gm)):
                if outcomes:
                    delete_meta(graph)
                try:
                    passes.lower_to_dtensor(graph, fake_mesh)
                    outcomes.append({n: m.code for n, m in graph.named_modules() if isinstance(m, torch.fx.GraphModule)})
                except passes.PassError as error:
                    outcomes.append(str(error))
            assert outcomes[0] == outcomes[1], sample.name
