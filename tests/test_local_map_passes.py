"""Passes over local_map regions: inlining (when it keeps results) and placement checking."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import TestCase, readable

MESH = Mesh((2, 2), ("data", "model"))
ROWS = (Shard(0), Replicate())


def scale(x):
    return x * 3


def matmul(x, w):
    return x @ w


replicated_scale = hops.local_map(
    scale, mesh=MESH, in_placements=((Replicate(), Replicate()),), out_placements=(Replicate(), Replicate())
)
row_scale = hops.local_map(scale, mesh=MESH, in_placements=(ROWS,), out_placements=ROWS)
# Scaling is linear, so it may run on pending sums and leave them pending.
partial_scale = hops.local_map(
    scale, mesh=MESH, in_placements=((Shard(0), Partial()),), out_placements=(Shard(0), Partial())
)
sharded_matmul = hops.local_map(
    matmul,
    mesh=MESH,
    in_placements=((Shard(0), Shard(1)), (Replicate(), Shard(0))),
    out_placements=(Shard(0), Partial()),
)


class TestInlineLocalMap(TestCase):
    def test_region_inlines_into_its_per_device_program(self):
        # A region in a global graph becomes what its eager semantics define: each device's
        # shard sliced out, the body per device, the outputs assembled.
        pair = Mesh((2,), ("data",))
        rows = hops.local_map(scale, mesh=pair, in_placements=((Shard(0),),), out_placements=(Shard(0),))
        x = torch.randn(4, 4)
        gm = passes.inline_hops(make_fx(lambda t: rows(t) + 1)(x))
        self.assertExpectedInline(readable(gm), """\
class <lambda>(torch.nn.Module):
    def forward(self, t_1: "f32[4, 4]"):
        chunk_default = torch.ops.aten.chunk.default(t_1, 2, 0)
        getitem_1: "f32[2, 4]" = chunk_default[0]
        mul: "f32[2, 4]" = torch.ops.aten.mul.Tensor(getitem_1, 3)
        getitem_2: "f32[2, 4]" = chunk_default[1]
        mul_1: "f32[2, 4]" = torch.ops.aten.mul.Tensor(getitem_2, 3)
        cat_default = torch.ops.aten.cat.default([mul, mul_1], 0)
        add: "f32[4, 4]" = torch.ops.aten.add.Tensor(cat_default, 1)
        return add
""")
        self.assertEqual(gm(x), x * 3 + 1)

    def test_replicated_outputs_are_checked_to_agree(self):
        # Declared Replicate, the devices' values must agree, as the eager simulation checks.
        def by_device(x):
            return x + x.sum()  # differs between row shards

        wrong = hops.local_map(by_device, mesh=MESH, in_placements=(ROWS,), out_placements=(Replicate(), Replicate()))
        x = torch.randn(4, 4)
        with self.assertRaises(ValueError) as eager:
            wrong(x)
        gm = passes.inline_hops(make_fx(wrong, tracing_mode="fake")(x))
        with self.assertRaises(ValueError) as inlined:
            gm(x)
        for error in (eager.exception, inlined.exception):
            self.assertRegex(str(error), r"^local_map\(by_device\): output\[0\] is declared Replicate on mesh axis 'data'")
        # Integers must agree exactly, as eagerly.
        counts = hops.local_map(
            lambda n: n + (n.sum() > 10**6).long(), mesh=MESH, in_placements=(ROWS,), out_placements=(Replicate(), Replicate())
        )
        n = torch.full((4, 4), 10**6 // 8)
        n[0, 0] += 100
        with self.assertRaisesRegex(ValueError, "declared Replicate"):
            counts(n)
        with self.assertRaisesRegex(ValueError, "declared Replicate"):
            passes.inline_hops(make_fx(counts, tracing_mode="fake")(n))(n)

    def test_inlined_regions_compute_the_eager_results(self):
        x, w = torch.randn(8, 6), torch.randn(6, 4)
        for region, inputs in (
            (replicated_scale, (x,)),
            (row_scale, (x,)),
            (partial_scale, (x,)),
            (sharded_matmul, (x, w)),
        ):
            gm = passes.inline_hops(make_fx(region, tracing_mode="fake")(*inputs))
            torch.testing.assert_close(gm(*inputs), region(*inputs))

    def test_per_device_graph_inlines_every_region(self):
        # In per-device form each device runs the graph on its own shards: the region's
        # body is exactly what runs, and a Partial output stays a pending local sum.
        gm = passes.inline_hops(make_fx(sharded_matmul)(torch.randn(8, 6), torch.randn(6, 4)), per_device=True)
        self.assertExpectedInline(readable(gm), """\
class matmul(torch.nn.Module):
    def forward(self, x_1: "f32[8, 6]", w_1: "f32[6, 4]"):
        mm: "f32[4, 4]" = torch.ops.aten.mm.default(x_1, w_1)
        return mm
""")
        local_x, local_w = torch.randn(4, 3), torch.randn(3, 4)
        self.assertEqual(gm(local_x, local_w), local_x @ local_w)


class TestCheckPlacements(TestCase):
    def test_consistent_plan_passes(self):
        def plan(x, w):
            x = hops.annotate_sharding(x, ShardingSpec(MESH, (Shard(0), Shard(1))))
            y = sharded_matmul(x, w)
            return hops.annotate_sharding(partial_scale(y), ShardingSpec(MESH, (Shard(0), Partial())))

        gm = make_fx(plan)(torch.randn(8, 6), torch.randn(6, 4))
        self.assertIs(passes.check_placements(gm), gm)

    def test_an_annotation_on_a_pending_sum_states_its_reduction_and_nothing_else(self):
        # sharded_matmul's output is (Shard(0), Partial()): an annotation may reduce the sum
        # into any placement on "model" (all-reduce, reduce-scatter) or keep it, but must keep
        # the rows as the region lays them out.
        def annotated(placements):
            def plan(x, w):
                return hops.annotate_sharding(sharded_matmul(x, w), ShardingSpec(MESH, placements))

            return make_fx(plan)(torch.randn(8, 6), torch.randn(6, 4))

        for reduced in ((Shard(0), Replicate()), (Shard(0), Shard(1)), (Shard(0), Shard(0)), (Shard(0), Partial())):
            passes.check_placements(annotated(reduced))
        for changed in ((Replicate(), Replicate()), (Shard(1), Replicate()), (Partial(), Partial()), (Shard(0), Partial("max"))):
            with self.assertRaisesRegex(passes.PassError, "hops_local_map output 0: annotation hops_sharding_annotation lays it out as"):
                passes.check_placements(annotated(changed))

    def test_on_an_axis_of_size_one_every_layout_agrees(self):
        # One device holds the whole value on such an axis: Shard, Replicate and a pending sum
        # are the same layout there. A disagreement on another axis is still reported.
        unit = Mesh((2, 1), ("data", "tensor"))
        region = hops.local_map(
            lambda x: x * 2, mesh=unit, in_placements=((Shard(0), Shard(1)),), out_placements=((Shard(0), Partial()),)
        )

        def annotated(stated_in, stated_out):
            def plan(x):
                x = hops.annotate_sharding(x, ShardingSpec(unit, stated_in))
                return hops.annotate_sharding(region(x), ShardingSpec(unit, stated_out))

            return make_fx(plan)(torch.randn(8, 6))

        for stated in ((Shard(0), Replicate()), (Shard(0), Shard(0)), (Shard(0), Partial())):
            passes.check_placements(annotated(stated, stated))
        with self.assertRaisesRegex(passes.PassError, "input 0: annotation .* lays it out as"):
            passes.check_placements(annotated((Replicate(), Shard(1)), (Shard(0), Replicate())))
        with self.assertRaisesRegex(passes.PassError, "output 0: annotation .* lays it out as"):
            passes.check_placements(annotated((Shard(0), Shard(1)), (Shard(1), Replicate())))

    def test_mismatches_are_reported_with_their_nodes(self):
        def plan(x, w):
            x = hops.annotate_sharding(x, ShardingSpec(MESH, (Shard(0), Replicate())))  # region wants Shard(1) on model
            w = hops.annotate_sharding(
                w, ShardingSpec(MESH, (Replicate(), Shard(0))), grad_spec=ShardingSpec(MESH, (Shard(1), Shard(1)))
            )  # the region produces (Partial, Shard(0)) for w's gradient: its rows would move
            y = sharded_matmul(x, w)  # out (Shard(0), Partial) feeds a region that wants (Shard(0), Replicate)
            z = row_scale(y)
            return hops.annotate_sharding(z, ShardingSpec(MESH, (Replicate(), Replicate())))

        gm = make_fx(plan)(torch.randn(8, 6), torch.randn(6, 4))
        with self.assertRaises(passes.PassError) as caught:
            passes.check_placements(gm)
        message = str(caught.exception)
        self.assertIn("hops_local_map input 0: annotation hops_sharding_annotation lays it out as (hops.Shard(0), hops.Replicate())", message)
        self.assertIn("wants its gradient as (hops.Shard(1), hops.Shard(1)), the region produces (hops.Partial(), hops.Shard(0))", message)
        self.assertIn("hops_local_map_1 input 0: output 0 of hops_local_map lays it out as (hops.Shard(0), hops.Partial())", message)
        self.assertIn("hops_local_map_1 output 0: annotation hops_sharding_annotation_2", message)
        self.assertEqual(message.count("\n"), 4)

    def test_a_different_mesh_is_a_mismatch(self):
        other = Mesh((4,), ("x",))

        def plan(x):
            return row_scale(hops.annotate_sharding(x, ShardingSpec(other, (Shard(0),))))

        gm = make_fx(plan)(torch.randn(4, 4))
        with self.assertRaisesRegex(passes.PassError, r"is on hops.Mesh.of\(x=4\), the region on hops.Mesh.of\(data=2, model=2\)"):
            passes.check_placements(gm)


if __name__ == "__main__":
    pytest.main([__file__])
