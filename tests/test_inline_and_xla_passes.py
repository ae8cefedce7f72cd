"""inline_hops and lower_to_xla as graph rewrites: recursion, numerics, lint, errors."""

import copy

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec
from passes.xla import ops as xla_ops
from tests.helpers.snapshot import TestCase, delete_meta, readable

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
COLS = ShardingSpec(MESH, (Replicate(), Shard(1)))


def branchy(x):
    """An annotation in the root graph and one in each branch subgraph of torch.cond."""

    def positive(t):
        return hops.annotate_sharding(t.sin(), ROWS)

    def negative(t):
        return hops.annotate_sharding(t.cos(), COLS, grad_spec=ROWS)

    y = hops.annotate_sharding(x + 1, COLS)
    return torch.cond(y.sum() > 0, positive, negative, (y,))


def hop_nodes(gm, target):
    return [
        (module_name, node.name)
        for module_name, module in gm.named_modules()
        if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes
        if node.target is target
    ]


class TestInline(TestCase):
    def test_inline_removes_annotations_everywhere_and_keeps_numerics(self):
        x = torch.randn(4, 4)
        gm = make_fx(branchy)(x)
        self.assertEqual(
            hop_nodes(gm, hops.sharding_annotation_hop),
            [("", "hops_sharding_annotation"), ("true_graph_0", "hops_sharding_annotation"),
             ("false_graph_0", "hops_sharding_annotation")],
        )
        inlined = passes.inline_hops(copy.deepcopy(gm))
        self.assertEqual(hop_nodes(inlined, hops.sharding_annotation_hop), [])
        for sample in (x, -x - 5):
            self.assertEqual(inlined(sample), branchy(sample))
        self.assertExpectedInline(readable(inlined.true_graph_0), """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 4]"):
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(arg0_1)
        return (sin,)
""")

    def test_inline_keeps_node_names_of_untouched_nodes(self):
        gm = make_fx(lambda x: hops.annotate_sharding(x.sin(), ROWS).cos())(torch.randn(4, 4))
        names_before = [n.name for n in gm.graph.nodes if n.target is not hops.sharding_annotation_hop]
        passes.inline_hops(gm)
        self.assertEqual([n.name for n in gm.graph.nodes], names_before)


class TestLowerToXla(TestCase):
    def test_lowering_rewrites_every_subgraph_in_place(self):
        x = torch.randn(4, 4)
        gm = passes.lower_to_xla(make_fx(branchy)(x))
        self.assertEqual(hop_nodes(gm, hops.sharding_annotation_hop), [])
        self.assertEqual(
            hop_nodes(gm, xla_ops.sharding_constraint),
            [("", "hops_sharding_annotation"), ("true_graph_0", "hops_sharding_annotation"),
             ("false_graph_0", "hops_sharding_annotation")],
        )
        self.assertExpectedInline(readable(gm.false_graph_0), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 4]"):
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(arg0_1)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.hops_xla.sharding_constraint.default(cos, "hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'RS(1)', 'S(0)R')")
        return (hops_sharding_annotation,)
""")
        # Off XLA the lowered ops are identities, so the graph still computes the same values.
        for sample in (x, -x - 5):
            self.assertEqual(gm(sample), branchy(sample))

    def test_lowered_graph_still_traces_with_fake_tensors(self):
        gm = passes.lower_to_xla(make_fx(branchy)(torch.randn(4, 4)))
        retraced = make_fx(gm, tracing_mode="fake")(torch.randn(4, 4))
        self.assertEqual(len(hop_nodes(retraced, xla_ops.sharding_constraint)), 3)

    def test_partial_annotation_is_refused_naming_the_node(self):
        partial = ShardingSpec(MESH, (Partial(), Replicate()))
        gm = make_fx(lambda x: hops.annotate_sharding(x * 2, partial))(torch.randn(4, 4))
        with self.assertRaisesRegex(passes.PassError, r"hops_sharding_annotation.* lays out its value with a Partial placement"):
            passes.lower_to_xla(gm)

    def test_a_hand_edited_node_with_a_non_spec_is_refused(self):
        gm = make_fx(lambda x: hops.annotate_sharding(x * 2, ROWS))(torch.randn(4, 4))
        node = next(n for n in gm.graph.nodes if n.target is hops.sharding_annotation_hop)
        node.args = (node.args[0], "('data', None)")
        for run_pass in (passes.lower_to_xla, passes.inline_hops, passes.unroll_scan, passes.check_placements):
            with self.assertRaisesRegex(passes.PassError, "hops_sharding_annotation.*must be a hops.ShardingSpec, got str"):
                run_pass(copy.deepcopy(gm))


class TestPassContracts(TestCase):
    @pytest.mark.filterwarnings("ignore")
    def test_passes_refuse_non_graph_modules(self):
        for run_pass in (passes.inline_hops, passes.lower_to_xla):
            with self.assertRaisesRegex(TypeError, "expects a torch.fx.GraphModule, got Linear"):
                run_pass(torch.nn.Linear(2, 2))

    def test_passes_lint_what_they_return(self):
        # A rule that breaks topological order must be caught by the pass's lint, not later.
        gm = make_fx(lambda x: hops.annotate_sharding(x * 2, ROWS) + 1)(torch.randn(4, 4))

        def move_before_its_input(node):
            next(iter(node.graph.nodes)).prepend(node)

        broken = passes.HopRulePass("inline", rules={hops.sharding_annotation_hop: move_before_its_input})
        with self.assertRaisesRegex(RuntimeError, "used before it has been defined"):
            broken(gm)

    def test_meta_free(self):
        x = torch.randn(4, 4)
        gm = make_fx(branchy)(x)
        for run_pass in (passes.inline_hops, passes.lower_to_xla):
            with_meta = run_pass(copy.deepcopy(gm))
            stripped = copy.deepcopy(gm)
            delete_meta(stripped)
            without_meta = run_pass(stripped)
            for name in ("", "true_graph_0", "false_graph_0"):
                self.assertEqual(
                    without_meta.get_submodule(name).code, with_meta.get_submodule(name).code
                )
            self.assertEqual(without_meta(x), with_meta(x))
