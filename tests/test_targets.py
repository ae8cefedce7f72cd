"""Every lowering target is a table of rules (``passes/_infra.py``): every HOP has a rule for
every target, lowered graphs compute the reference (forward and backward), HOPs nested in
bodies are lowered wherever they are, lowered graphs round-trip through pickle and deepcopy,
and graphs a pass cannot take get a ``PassError`` naming the node."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import LocalMapSpec, Partial, Replicate, Shard, ShardingSpec
from hops._body_hop.base import BodyHOP
from passes._infra import is_package_hop
from tests.helpers.hop_db import MESH, ROWS, SAMPLES
from tests.helpers.snapshot import TestCase, readable
from tests.test_frontends import operations

TARGETS = {"inline": passes.inline_hops, "unroll": passes.unroll_scan, "xla": passes.lower_to_xla}


@hops.kernel(abstract=lambda x, *, scale: torch.empty_like(x))
def scaled(x, *, scale):
    return x * scale


def package_hops() -> list:
    """Every HOP of this package that exists now (test kernels included)."""
    return [
        hop
        for hop in torch._ops._higher_order_ops.values()
        if is_package_hop(hop) and not hop.__name__.startswith("hops_test_")
    ]


def joint(program):
    """``program``'s outputs and the gradients of their sum, as one function to trace."""

    def outputs_and_grads(*inputs):
        outputs = program(*inputs)
        loss = sum(o.sum() for o in pytree.tree_leaves(outputs))
        return outputs, torch.autograd.grad(loss, inputs)

    return outputs_and_grads


def hop_targets(gm: fx.GraphModule) -> set:
    return {
        node.target.__name__
        for module in passes.graph_modules(gm)
        for node in module.graph.nodes
        if node.op == "call_function" and is_package_hop(node.target)
    }


class TestRuleTables(TestCase):
    def test_every_hop_has_a_rule_for_every_target(self):
        hops_now = package_hops()
        self.assertIn(hops.scan_hop, hops_now)
        self.assertIn(scaled, hops_now)
        for target in (*TARGETS, "dtensor"):  # dtensor needs a process group: tests/test_dtensor.py runs it
            for hop in hops_now:
                self.assertIsNotNone(passes.rule_for(target, hop), f"no {target!r} rule for {hop.__name__}")

    def test_a_hop_without_a_rule_is_refused_by_every_pass(self):
        class Unknown(BodyHOP):
            spec_type = ShardingSpec

            def __init__(self):
                super().__init__("hops_test_without_rules")

        unknown = Unknown()
        gm = make_fx(lambda x: x * 2)(torch.randn(4))
        (mul,) = [n for n in gm.graph.nodes if n.op == "call_function"]
        with gm.graph.inserting_after(mul):
            call = gm.graph.call_function(unknown, (mul, ROWS))
        output = next(iter(gm.graph.find_nodes(op="output")))
        output.args = (call,)
        gm.recompile()
        for name, run_pass in TARGETS.items():
            if name == "unroll":
                continue  # unroll keeps every HOP but scans: it needs no rule for others
            with self.assertRaisesRegex(passes.PassError, rf"no '{name}' rule for .*hops_test_without_rules"):
                run_pass(copy.deepcopy(gm))
        with self.assertRaisesRegex(passes.PassError, r"no 'unroll' rule for .*hops_test_without_rules"):
            passes.unroll_scan(copy.deepcopy(gm))

    def test_a_target_can_refuse_a_hop_with_its_reason(self):
        passes.register_rule("refusing", hops.sharding_annotation_hop)(passes.refuse("annotations are not taken here"))
        self.addCleanup(passes.RULES.pop, "refusing")  # a test target, not one every HOP must join
        gm = make_fx(lambda x: hops.annotate_sharding(x, ROWS))(torch.randn(4, 4))
        with self.assertRaisesRegex(passes.PassError, r"hops_sharding_annotation.*annotations are not taken here"):
            passes.HopRulePass("refusing")(gm)


class TestLoweredGraphsCompute(TestCase):
    """``test_<sample>_<target>``: the joint graph (outputs and gradients) of each sample,
    lowered, computes the reference on new inputs, before and after a pickle round trip."""

    def check(self, sample, target):
        inputs, fresh = sample.inputs(0), sample.inputs(1)
        graph = make_fx(joint(sample.program), tracing_mode="fake")(*inputs)
        lowered = TARGETS[target](graph)
        expected = joint(sample.reference)(*fresh)
        detached = [t.detach() for t in fresh]
        if target == "xla" and "hops_local_map" in hop_targets(make_fx(sample.program, tracing_mode="fake")(*inputs)):
            # A manual-sharding region runs only on XLA tensors (test_xla_lowering.py runs it).
            with self.assertRaisesRegex(RuntimeError, "manual-sharding regions run only on XLA tensors"):
                lowered(*detached)
            return
        if target != "unroll":
            self.assertEqual(hop_targets(lowered), set())
        for graph_module in (lowered, copy.deepcopy(lowered), pickle.loads(pickle.dumps(lowered))):
            torch.testing.assert_close(graph_module(*detached), expected)
        self.assertEqual(operations(pickle.loads(pickle.dumps(lowered))), operations(lowered))


def _add_tests() -> None:
    for sample in SAMPLES:
        for target in TARGETS:
            setattr(
                TestLoweredGraphsCompute,
                f"test_{sample.name}_{target}",
                lambda self, sample=sample, target=target: self.check(sample, target),
            )


_add_tests()


# --------------------------------------------------------------------------- nesting


def annotated_scale(x):
    return hops.annotate_sharding(x * 3, ShardingSpec(MESH, (Replicate(), Replicate())))


scale_rows = hops.local_map(annotated_scale, mesh=MESH, in_placements=(ROWS.placements,), out_placements=ROWS.placements)


def inner_scan(c, x):
    def inner(d, v):
        d = torch.tanh(d + v * c)
        return d, d.sum()

    d, sums = hops.scan(inner, c, x)
    return d, sums


def nested_scans(c, xs):
    return hops.scan(inner_scan, c, xs)


def python_nested_scans(c, xs):
    ys = []
    for x in xs:
        d, sums = c, []
        for v in x:
            d = torch.tanh(d + v * c)
            sums.append(d.sum())
        c = d
        ys.append(torch.stack(sums))
    return c, torch.stack(ys)


class TestNesting(TestCase):
    def test_inline_reaches_an_annotation_in_a_region_body(self):
        x = torch.randn(4, 4)
        gm = passes.inline_hops(make_fx(scale_rows, tracing_mode="fake")(x))
        self.assertEqual(hop_targets(gm), set())
        torch.testing.assert_close(gm(x), x * 3)

    def test_unroll_unrolls_a_scan_in_a_scan(self):
        c, xs = torch.randn(3), torch.randn(2, 4, 3)
        gm = passes.unroll_scan(make_fx(nested_scans, tracing_mode="fake")(c, xs))
        self.assertEqual(hop_targets(gm), set())
        torch.testing.assert_close(gm(c, xs), python_nested_scans(c, xs))

    def test_every_target_lowers_a_scan_in_a_scan(self):
        c, xs = torch.randn(3), torch.randn(2, 4, 3)
        for name, run_pass in TARGETS.items():
            gm = run_pass(make_fx(nested_scans, tracing_mode="fake")(c, xs))
            self.assertEqual(hop_targets(gm), set(), name)
            torch.testing.assert_close(gm(c, xs), python_nested_scans(c, xs))

    def test_a_scan_in_a_region_and_a_region_in_a_scan(self):
        def region_body(c, xs):
            return hops.scan(lambda h, x: (torch.tanh(h + x), h.sum()), c, xs)

        rows = (Shard(0), Replicate())
        region = hops.local_map(
            region_body, mesh=MESH, in_placements=(rows, (Shard(1), Replicate())), out_placements=(rows, (Partial(), Replicate()))
        )

        def scan_of_regions(c, xs):
            return hops.scan(lambda h, x: (scale_rows(h) + x, None), c, xs)

        c, xs = torch.randn(4, 3), torch.randn(5, 4, 3)
        for program, inputs in ((scan_of_regions, (c, xs)), (lambda h: region(h, torch.zeros(5, 4, 3))[0], (c,))):
            reference = program(*inputs)
            for name in ("inline", "unroll"):
                gm = TARGETS[name](make_fx(program, tracing_mode="fake")(*inputs))
                if name == "inline":
                    self.assertEqual(hop_targets(gm), set())
                torch.testing.assert_close(gm(*inputs), reference)
        # Unrolled then inlined: loop-free plain ATen.
        gm = passes.inline_hops(passes.unroll_scan(make_fx(scan_of_regions, tracing_mode="fake")(c, xs)))
        self.assertEqual(hop_targets(gm), set())
        self.assertNotIn("run_scan", gm.code)
        torch.testing.assert_close(gm(c, xs), scan_of_regions(c, xs))


# --------------------------------------------------------------------------- bad graphs


def edited(gm: fx.GraphModule, hop, edit) -> fx.GraphModule:
    node = next(n for m in passes.graph_modules(gm) for n in m.graph.nodes if n.target is hop)
    edit(node)
    return gm


class TestBadGraphs(TestCase):
    def test_passes_refuse_what_is_not_a_graph_module(self):
        for run_pass in (*TARGETS.values(), passes.check_placements):
            with self.assertRaisesRegex(TypeError, "expects a torch.fx.GraphModule, got Linear"):
                run_pass(torch.nn.Linear(2, 2))

    def test_a_string_spec_is_refused_by_every_pass_and_runner(self):
        def stringify(node):
            node.args = (*node.args[:-1], repr(node.args[-1]))

        x, xs = torch.randn(4, 4), torch.randn(3, 4, 4)
        programs = [
            (lambda x: hops.annotate_sharding(x, ROWS), hops.sharding_annotation_hop, (x,)),
            (scale_rows, hops.local_map_hop, (x,)),
            (lambda c, xs: hops.scan(lambda h, x: (h + x, None), c, xs), hops.scan_hop, (x, xs)),
            (hops.named_scope("block")(lambda x: x.sin()), hops.named_scope_hop, (x,)),
            (lambda x: scaled(x, scale=2.0), scaled, (x,)),
        ]
        for program, hop, inputs in programs:
            gm = make_fx(program, tracing_mode="fake")(*inputs)
            for run_pass in (*TARGETS.values(), passes.check_placements):
                with self.assertRaisesRegex(passes.PassError, rf"{hop.__name__}.*must be a hops\.\w+, got str"):
                    run_pass(edited(copy.deepcopy(gm), hop, stringify))
        # A lowered scan edited afterwards: its runner names itself.
        gm = passes.lower_to_xla(make_fx(programs[2][0], tracing_mode="fake")(x, xs))
        node = next(n for n in gm.graph.nodes if n.target is passes.run_scan)
        node.args = (*node.args[:-1], "ScanSpec(1, 1)")
        gm.recompile()
        with self.assertRaisesRegex(TypeError, "run_scan: the last argument must be a hops.ScanSpec, got str"):
            gm(x, xs)

    def test_a_region_spec_that_does_not_fit_its_operands(self):
        x = torch.randn(4, 4)
        gm = make_fx(scale_rows, tracing_mode="fake")(x)

        def fewer_placements(node):
            spec = node.args[-1]
            node.args = (*node.args[:-1], LocalMapSpec(spec.mesh, (), spec.out_placements))

        for run_pass in (*TARGETS.values(), passes.check_placements):
            if run_pass is passes.unroll_scan:
                continue  # keeps regions as they are
            with self.assertRaisesRegex(passes.PassError, r"hops_local_map.*1 operands but its spec has 0 in_placements"):
                run_pass(edited(copy.deepcopy(gm), hops.local_map_hop, fewer_placements))

    def test_a_shard_beyond_the_rank_is_refused_at_lowering(self):
        gm = make_fx(lambda x: hops.annotate_sharding(x, ROWS))(torch.randn(4, 4))

        def shard_dim_3(node):
            node.args = (node.args[0], ShardingSpec(MESH, (Shard(3), Replicate())))

        with self.assertRaisesRegex(passes.PassError, r"hops_sharding_annotation.*Shard\(3\).*rank 2"):
            passes.lower_to_xla(edited(gm, hops.sharding_annotation_hop, shard_dim_3))

        region = make_fx(scale_rows, tracing_mode="fake")(torch.randn(4, 4))

        def region_shard_dim_3(node):
            spec = node.args[-1]
            node.args = (*node.args[:-1], LocalMapSpec(spec.mesh, ((Shard(3), Replicate()),), spec.out_placements))

        for run_pass in (passes.lower_to_xla, passes.inline_hops):
            with self.assertRaisesRegex(passes.PassError, r"hops_local_map.*Shard\(3\).*rank 2"):
                run_pass(edited(copy.deepcopy(region), hops.local_map_hop, region_shard_dim_3))


@pytest.mark.xla
def test_a_mesh_that_is_not_the_xla_devices_is_refused_at_lowering():
    from hops import Mesh

    eight = ShardingSpec(Mesh.of(data=4, model=2), "S(0)R")
    gm = make_fx(lambda x: hops.annotate_sharding(x, eight))(torch.randn(8, 8))
    with pytest.raises(passes.PassError, match=r"hops_sharding_annotation.*has devices \[0, .*7\].*4 XLA devices"):
        passes.lower_to_xla(gm)


# --------------------------------------------------------------------------- export


def annotated_step(c, x):
    c = hops.annotate_sharding(torch.tanh(c * x.sum() + x), ROWS)
    y = scaled(scale_rows(c), scale=0.5)
    return c, y


class ScanModule(torch.nn.Module):
    def forward(self, c, xs):
        return hops.scan(annotated_step, c, xs)


class TestExportedScan(TestCase):
    def test_the_step_is_traced_once_and_only_inside_the_scan(self):
        # Nothing of the step leaks to the top level (a solver reading the graph would see
        # placements that do not exist), and decompositions run on the exported program.
        c, xs = torch.randn(4, 4), torch.randn(5, 4, 4)
        for strict in (False, True):
            program = torch.export.export(ScanModule(), (c, xs), strict=strict)
            top = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
            self.assertEqual(
                [str(getattr(n.target, "__name__", n.target)) for n in top], ["hops_scan", "getitem", "getitem"]
            )
            decomposed = program.run_decompositions()
            torch.testing.assert_close(decomposed.module()(c, xs), ScanModule()(c, xs))
            self.assertEqual(
                hop_targets(decomposed.graph_module),
                {"hops_scan", "hops_sharding_annotation", "hops_local_map", "hops_kernel_scaled"},
            )

    def test_the_exported_step_reads_as_the_users(self):
        program = torch.export.export(ScanModule(), (torch.randn(4, 4), torch.randn(5, 4, 4)))
        self.assertExpectedInline(readable(program.graph_module), """\
class GraphModule(torch.nn.Module):
    def forward(self, c: "f32[4, 4]", xs: "f32[5, 4, 4]"):
        annotated_step_body_0 = self.annotated_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(annotated_step_body_0, c, xs, hops.ScanSpec(1, 1, length=5))
        getitem: "f32[4, 4]" = hops_scan[0]
        getitem_1: "f32[5, 4, 4]" = hops_scan[1]
        return (getitem, getitem_1)
    class annotated_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[4, 4]", arg1_1: "f32[4, 4]"):
            sum_1: "f32[]" = torch.ops.aten.sum.default(arg1_1)
            mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(arg0_1, sum_1)
            add: "f32[4, 4]" = torch.ops.aten.add.Tensor(mul, arg1_1)
            tanh: "f32[4, 4]" = torch.ops.aten.tanh.default(add)
            hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(tanh, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R'))
            annotated_scale_body_0 = self.annotated_scale_body_0
            hops_local_map = torch.ops.higher_order.hops_local_map(annotated_scale_body_0, hops_sharding_annotation, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'S(0)R'))
            getitem: "f32[4, 4]" = hops_local_map[0]
            hops_kernel_scaled: "f32[4, 4]" = torch.ops.higher_order.hops_kernel_scaled(getitem, hops.KernelParams.of(scale=0.5))
            return (hops_sharding_annotation, hops_kernel_scaled)
        class annotated_scale_body_0(torch.nn.Module):
            def forward(self, arg0_1: "f32[2, 4]"):
                mul: "f32[2, 4]" = torch.ops.aten.mul.Tensor(arg0_1, 3)
                hops_sharding_annotation: "f32[2, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'RR'))
                return (hops_sharding_annotation,)
""")
