"""Sample programs, one per HOP of this package: the table every frontend test runs.

Like torch's ``hop_db``: each sample is a small program that calls one HOP the way users
do, the same computation in plain torch (the reference), and fresh inputs. A sample also
holds the snapshots of the graphs its frontends record (``snapshot_<frontend>``), so the
graphs documenting one HOP read together; ``test_frontends.py`` runs every sample through
every frontend.
"""

from __future__ import annotations

import torch

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
COLUMNS = ShardingSpec(MESH, (Replicate(), Shard(1)))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- running samples


class Module(torch.nn.Module):
    """A sample's program as a module (what torch.export takes)."""

    def __init__(self, program):
        super().__init__()
        self.program = program

    def forward(self, *inputs):
        return self.program(*inputs)


def fresh(inputs):
    """New leaves with the same values and requires_grad."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


def forward_backward(fn, inputs):
    """``fn``'s outputs (flattened) and the inputs' gradients after one backward of the
    outputs weighted by their position (so every output's cotangent differs)."""
    import torch.utils._pytree as pytree

    outputs = pytree.tree_leaves(fn(*inputs))
    sum((o * (i + 1)).sum() for i, o in enumerate(outputs) if o.is_floating_point()).backward()
    return outputs, [t.grad for t in inputs]


class Sample:
    """``program(*inputs)`` uses ``hop``; ``reference(*inputs)`` is the same in plain torch."""

    name: str
    hop: object

    @staticmethod
    def inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @staticmethod
    def program(*inputs):
        raise NotImplementedError

    @staticmethod
    def reference(*inputs):
        raise NotImplementedError


# --------------------------------------------------------------------------- annotation


class Annotation(Sample):
    name = "annotation"
    hop = hops.sharding_annotation_hop

    @staticmethod
    def inputs(seed=0):
        return (torch.randn(4, 4, generator=generator(seed), requires_grad=True),)

    @staticmethod
    def program(x):
        return hops.annotate_sharding(x * 2, ROWS, grad_spec=COLUMNS).sin()

    @staticmethod
    def reference(x):
        return (x * 2).sin()

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x_1, 2)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'RS(1)'))
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        return sin
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(primals_1, 2)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'RS(1)'))
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        return (sin, hops_sharding_annotation)
class GraphModule(torch.nn.Module):
    def forward(self, hops_sharding_annotation: "f32[4, 4]", tangents_1: "f32[4, 4]"):
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation)
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, cos)
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'RS(1)', 'S(0)R'))
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2)
        return (mul_2,)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(inputs_0, 2)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'RS(1)'))
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        return (sin,)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 4]"):
        l_x_ = L_x_
        mul: "f32[4, 4]" = l_x_ * 2
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'RS(1)'))
        sin: "f32[4, 4]" = hops_sharding_annotation.sin()
        return (sin,)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(primals_1, 2)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'RS(1)'))
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        return (sin, hops_sharding_annotation)
class GraphModule(torch.nn.Module):
    def forward(self, hops_sharding_annotation: "f32[4, 4]", tangents_1: "f32[4, 4]"):
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation)
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, cos)
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'RS(1)', 'S(0)R'))
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2)
        return (mul_2,)
""")


# --------------------------------------------------------------------------- local_map


def scaled_matmul(x, w):
    return torch.tanh(x @ w) * 2


sharded_matmul = hops.local_map(
    scaled_matmul,
    mesh=MESH,
    in_placements=((Shard(0), Replicate()), (Replicate(), Replicate())),
    out_placements=(Shard(0), Replicate()),
)


class LocalMap(Sample):
    name = "local_map"
    hop = hops.local_map_hop

    @staticmethod
    def inputs(seed=0):
        g = generator(seed)
        return (torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(3, 2, generator=g, requires_grad=True))

    @staticmethod
    def program(x, w):
        return sharded_matmul(x, w)

    @staticmethod
    def reference(x, w):
        return scaled_matmul(x, w)

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[4, 3]", w_1: "f32[3, 2]"):
        scaled_matmul_body_0 = self.scaled_matmul_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(scaled_matmul_body_0, x_1, w_1, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR', 'S(0)R'))
        getitem: "f32[4, 2]" = hops_local_map[0]
        return getitem
    class scaled_matmul_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 2]"):
            mm: "f32[2, 2]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            tanh: "f32[2, 2]" = torch.ops.aten.tanh.default(mm)
            mul: "f32[2, 2]" = torch.ops.aten.mul.Tensor(tanh, 2)
            return (mul,)
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 3]", primals_2: "f32[3, 2]"):
        scaled_matmul_body_0 = self.scaled_matmul_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(scaled_matmul_body_0, primals_1, primals_2, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR', 'S(0)R, S(0)S(0)'))
        getitem: "f32[4, 2]" = hops_local_map[0]
        getitem_1: "f32[8, 2]" = hops_local_map[1]
        return (getitem, primals_1, primals_2, getitem_1)
    class scaled_matmul_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 2]"):
            mm: "f32[2, 2]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            tanh: "f32[2, 2]" = torch.ops.aten.tanh.default(mm)
            mul: "f32[2, 2]" = torch.ops.aten.mul.Tensor(tanh, 2)
            return (mul, tanh)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 3]", primals_2: "f32[3, 2]", getitem_1: "f32[8, 2]", tangents_1: "f32[4, 2]"):
        scaled_matmul_bwd_body_0 = self.scaled_matmul_bwd_body_0
        hops_local_map_1 = torch.ops.higher_order.hops_local_map(scaled_matmul_bwd_body_0, primals_1, primals_2, getitem_1, tangents_1, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR, S(0)S(0), S(0)P', 'S(0)P, PP'))
        getitem_2: "f32[4, 3]" = hops_local_map_1[0]
        getitem_3: "f32[3, 2]" = hops_local_map_1[1]
        return (getitem_2, getitem_3)
    class scaled_matmul_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 2]", arg2_1: "f32[2, 2]", arg3_1: "f32[2, 2]"):
            mul: "f32[2, 2]" = torch.ops.aten.mul.Tensor(arg3_1, 2)
            tanh_backward: "f32[2, 2]" = torch.ops.aten.tanh_backward.default(mul, arg2_1)
            t: "f32[3, 2]" = torch.ops.aten.t.default(arg0_1)
            mm: "f32[3, 2]" = torch.ops.aten.mm.default(t, tanh_backward)
            t_1: "f32[2, 3]" = torch.ops.aten.t.default(arg1_1)
            mm_1: "f32[2, 3]" = torch.ops.aten.mm.default(tanh_backward, t_1)
            return (mm_1, mm)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[4, 3]", inputs_1: "f32[3, 2]"):
        scaled_matmul_body_0 = self.scaled_matmul_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(scaled_matmul_body_0, inputs_0, inputs_1, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR', 'S(0)R'))
        getitem: "f32[4, 2]" = hops_local_map[0]
        return (getitem,)
    class scaled_matmul_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 2]"):
            matmul: "f32[2, 2]" = torch.ops.aten.matmul.default(arg0_1, arg1_1)
            tanh: "f32[2, 2]" = torch.ops.aten.tanh.default(matmul)
            mul: "f32[2, 2]" = torch.ops.aten.mul.Tensor(tanh, 2)
            return (mul,)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 3]", L_w_: "f32[3, 2]"):
        l_x_ = L_x_
        l_w_ = L_w_
        scaled_matmul_body_0 = self.scaled_matmul_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(scaled_matmul_body_0, l_x_, l_w_, (), hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR', 'S(0)R'))
        outputs: "f32[4, 2]" = hops_local_map[0]
        return (outputs,)
    class scaled_matmul_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[2, 3]", l_w_: "f32[3, 2]"):
            matmul: "f32[2, 2]" = l_x_ @ l_w_
            tanh: "f32[2, 2]" = torch.tanh(matmul)
            result: "f32[2, 2]" = tanh * 2
            return (result,)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 3]", primals_2: "f32[3, 2]"):
        scaled_matmul_body_0 = self.scaled_matmul_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(scaled_matmul_body_0, primals_1, primals_2, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR', 'S(0)R, S(0)S(0)'))
        getitem: "f32[4, 2]" = hops_local_map[0]
        getitem_1: "f32[8, 2]" = hops_local_map[1]
        return (getitem, primals_1, primals_2, getitem_1)
    class scaled_matmul_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 2]"):
            mm: "f32[2, 2]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            tanh: "f32[2, 2]" = torch.ops.aten.tanh.default(mm)
            mul: "f32[2, 2]" = torch.ops.aten.mul.Tensor(tanh, 2)
            return (mul, tanh)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 3]", primals_2: "f32[3, 2]", getitem_1: "f32[8, 2]", tangents_1: "f32[4, 2]"):
        scaled_matmul_bwd_body_0 = self.scaled_matmul_bwd_body_0
        hops_local_map_1 = torch.ops.higher_order.hops_local_map(scaled_matmul_bwd_body_0, primals_1, primals_2, getitem_1, tangents_1, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR, S(0)S(0), S(0)P', 'S(0)P, PP'))
        getitem_2: "f32[4, 3]" = hops_local_map_1[0]
        getitem_3: "f32[3, 2]" = hops_local_map_1[1]
        return (getitem_2, getitem_3)
    class scaled_matmul_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 2]", arg2_1: "f32[2, 2]", arg3_1: "f32[2, 2]"):
            mul: "f32[2, 2]" = torch.ops.aten.mul.Tensor(arg3_1, 2)
            tanh_backward: "f32[2, 2]" = torch.ops.aten.tanh_backward.default(mul, arg2_1)
            t: "f32[3, 2]" = torch.ops.aten.t.default(arg0_1)
            mm: "f32[3, 2]" = torch.ops.aten.mm.default(t, tanh_backward)
            t_1: "f32[2, 3]" = torch.ops.aten.t.default(arg1_1)
            mm_1: "f32[2, 3]" = torch.ops.aten.mm.default(tanh_backward, t_1)
            return (mm_1, mm)
""")


# --------------------------------------------------------------------------- scan


def rnn_step(h, x, w):
    h = torch.tanh(h @ w + x)
    return h, h.sum(-1)


class Scan(Sample):
    name = "scan"
    hop = hops.scan_hop

    @staticmethod
    def inputs(seed=0):
        g = generator(seed)
        return (
            torch.randn(2, 3, generator=g, requires_grad=True),
            torch.randn(4, 2, 3, generator=g, requires_grad=True),
            torch.randn(3, 3, generator=g, requires_grad=True),
        )

    @staticmethod
    def program(h, xs, w):
        return hops.scan(rnn_step, h, xs, additional_inputs=(w,))

    @staticmethod
    def reference(h, xs, w):
        ys = []
        for x in xs:
            h, y = rnn_step(h, x, w)
            ys.append(y)
        return h, torch.stack(ys)

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, h_1: "f32[2, 3]", xs_1: "f32[4, 2, 3]", w_1: "f32[3, 3]"):
        rnn_step_body_0 = self.rnn_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(rnn_step_body_0, h_1, xs_1, w_1, hops.ScanSpec(1, 1, length=4))
        getitem: "f32[2, 3]" = hops_scan[0]
        getitem_1: "f32[4, 2]" = hops_scan[1]
        return (getitem, getitem_1)
    class rnn_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[2, 3]", arg2_1: "f32[3, 3]"):
            mm: "f32[2, 3]" = torch.ops.aten.mm.default(arg0_1, arg2_1)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mm, arg1_1)
            tanh: "f32[2, 3]" = torch.ops.aten.tanh.default(add)
            sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(tanh, [-1])
            return (tanh, sum_1)
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", primals_2: "f32[4, 2, 3]", primals_3: "f32[3, 3]"):
        rnn_step_body_0 = self.rnn_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(rnn_step_body_0, primals_1, primals_2, primals_3, hops.ScanSpec(1, 1, length=4))
        getitem: "f32[2, 3]" = hops_scan[0]
        getitem_1: "f32[4, 2]" = hops_scan[1]
        getitem_2: "f32[4, 2, 3]" = hops_scan[2]
        getitem_3: "f32[4, 2, 3]" = hops_scan[3]
        return (getitem, getitem_1, primals_3, getitem_2, getitem_3)
    class rnn_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[2, 3]", arg2_1: "f32[3, 3]"):
            mm: "f32[2, 3]" = torch.ops.aten.mm.default(arg0_1, arg2_1)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mm, arg1_1)
            tanh: "f32[2, 3]" = torch.ops.aten.tanh.default(add)
            sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(tanh, [-1])
            clone: "f32[2, 3]" = torch.ops.aten.clone.default(arg0_1)
            return (tanh, sum_1, clone, tanh)
class GraphModule(torch.nn.Module):
    def forward(self, primals_3: "f32[3, 3]", getitem_2: "f32[4, 2, 3]", getitem_3: "f32[4, 2, 3]", tangents_1: "f32[2, 3]", tangents_2: "f32[4, 2]"):
        new_zeros: "f32[3, 3]" = torch.ops.aten.new_zeros.default(tangents_1, [3, 3], dtype = torch.float32, pin_memory = False)
        rnn_step_bwd_body_0 = self.rnn_step_bwd_body_0
        hops_scan_1 = torch.ops.higher_order.hops_scan(rnn_step_bwd_body_0, tangents_1, new_zeros, getitem_2, getitem_3, tangents_2, primals_3, hops.ScanSpec(2, 3, length=4, reverse=True))
        getitem_4: "f32[2, 3]" = hops_scan_1[0]
        getitem_5: "f32[3, 3]" = hops_scan_1[1]
        getitem_6: "f32[4, 2, 3]" = hops_scan_1[2]
        return (getitem_4, getitem_6, getitem_5)
    class rnn_step_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]", arg2_1: "f32[2, 3]", arg3_1: "f32[2, 3]", arg4_1: "f32[2]", arg5_1: "f32[3, 3]"):
            unsqueeze: "f32[2, 1]" = torch.ops.aten.unsqueeze.default(arg4_1, -1)
            expand: "f32[2, 3]" = torch.ops.aten.expand.default(unsqueeze, [2, 3])
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(arg0_1, expand)
            tanh_backward: "f32[2, 3]" = torch.ops.aten.tanh_backward.default(add, arg3_1)
            t: "f32[3, 2]" = torch.ops.aten.t.default(arg2_1)
            mm: "f32[3, 3]" = torch.ops.aten.mm.default(t, tanh_backward)
            t_1: "f32[3, 3]" = torch.ops.aten.t.default(arg5_1)
            mm_1: "f32[2, 3]" = torch.ops.aten.mm.default(tanh_backward, t_1)
            add_1: "f32[3, 3]" = torch.ops.aten.add.Tensor(arg1_1, mm)
            return (mm_1, add_1, tanh_backward)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[2, 3]", inputs_1: "f32[4, 2, 3]", inputs_2: "f32[3, 3]"):
        rnn_step_body_0 = self.rnn_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(rnn_step_body_0, inputs_0, inputs_1, inputs_2, hops.ScanSpec(1, 1, length=4))
        getitem: "f32[2, 3]" = hops_scan[0]
        getitem_1: "f32[4, 2]" = hops_scan[1]
        return (getitem, getitem_1)
    class rnn_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[2, 3]", arg2_1: "f32[3, 3]"):
            matmul: "f32[2, 3]" = torch.ops.aten.matmul.default(arg0_1, arg2_1)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(matmul, arg1_1)
            tanh: "f32[2, 3]" = torch.ops.aten.tanh.default(add)
            sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(tanh, [-1])
            return (tanh, sum_1)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3]", L_xs_: "f32[4, 2, 3]", L_w_: "f32[3, 3]"):
        l_h_ = L_h_
        l_xs_ = L_xs_
        l_w_ = L_w_
        rnn_step_body_0 = self.rnn_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(rnn_step_body_0, l_h_, l_xs_, l_w_, (), hops.ScanSpec(1, 1, length=4))
        getitem: "f32[2, 3]" = hops_scan[0]
        getitem_1: "f32[4, 2]" = hops_scan[1]
        return (getitem, getitem_1)
    class rnn_step_body_0(torch.nn.Module):
        def forward(self, l_h_: "f32[2, 3]", l_xs_: "f32[2, 3]", l_w_: "f32[3, 3]"):
            matmul: "f32[2, 3]" = l_h_ @ l_w_
            add: "f32[2, 3]" = matmul + l_xs_
            h: "f32[2, 3]" = torch.tanh(add)
            y: "f32[2]" = h.sum(-1)
            return (h, y)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", primals_2: "f32[4, 2, 3]", primals_3: "f32[3, 3]"):
        rnn_step_body_0 = self.rnn_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(rnn_step_body_0, primals_1, primals_2, primals_3, hops.ScanSpec(1, 1, length=4))
        getitem: "f32[2, 3]" = hops_scan[0]
        getitem_1: "f32[4, 2]" = hops_scan[1]
        getitem_2: "f32[4, 2, 3]" = hops_scan[2]
        getitem_3: "f32[4, 2, 3]" = hops_scan[3]
        return (getitem, getitem_1, primals_3, getitem_2, getitem_3)
    class rnn_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[2, 3]", arg2_1: "f32[3, 3]"):
            mm: "f32[2, 3]" = torch.ops.aten.mm.default(arg0_1, arg2_1)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mm, arg1_1)
            tanh: "f32[2, 3]" = torch.ops.aten.tanh.default(add)
            sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(tanh, [-1])
            clone: "f32[2, 3]" = torch.ops.aten.clone.default(arg0_1)
            return (tanh, sum_1, clone, tanh)
class GraphModule(torch.nn.Module):
    def forward(self, primals_3: "f32[3, 3]", getitem_2: "f32[4, 2, 3]", getitem_3: "f32[4, 2, 3]", tangents_1: "f32[2, 3]", tangents_2: "f32[4, 2]"):
        new_zeros: "f32[3, 3]" = torch.ops.aten.new_zeros.default(tangents_1, [3, 3], dtype = torch.float32, pin_memory = False)
        rnn_step_bwd_body_0 = self.rnn_step_bwd_body_0
        hops_scan_1 = torch.ops.higher_order.hops_scan(rnn_step_bwd_body_0, tangents_1, new_zeros, getitem_2, getitem_3, tangents_2, primals_3, hops.ScanSpec(2, 3, length=4, reverse=True))
        getitem_4: "f32[2, 3]" = hops_scan_1[0]
        getitem_5: "f32[3, 3]" = hops_scan_1[1]
        getitem_6: "f32[4, 2, 3]" = hops_scan_1[2]
        return (getitem_4, getitem_6, getitem_5)
    class rnn_step_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]", arg2_1: "f32[2, 3]", arg3_1: "f32[2, 3]", arg4_1: "f32[2]", arg5_1: "f32[3, 3]"):
            unsqueeze: "f32[2, 1]" = torch.ops.aten.unsqueeze.default(arg4_1, -1)
            expand: "f32[2, 3]" = torch.ops.aten.expand.default(unsqueeze, [2, 3])
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(arg0_1, expand)
            tanh_backward: "f32[2, 3]" = torch.ops.aten.tanh_backward.default(add, arg3_1)
            t: "f32[3, 2]" = torch.ops.aten.t.default(arg2_1)
            mm: "f32[3, 3]" = torch.ops.aten.mm.default(t, tanh_backward)
            t_1: "f32[3, 3]" = torch.ops.aten.t.default(arg5_1)
            mm_1: "f32[2, 3]" = torch.ops.aten.mm.default(tanh_backward, t_1)
            add_1: "f32[3, 3]" = torch.ops.aten.add.Tensor(arg1_1, mm)
            return (mm_1, add_1, tanh_backward)
""")


# --------------------------------------------------------------------------- named scope


@hops.named_scope("block")
def block(x, w):
    return torch.relu(x @ w) + x


class NamedScope(Sample):
    name = "named_scope"
    hop = hops.named_scope_hop

    @staticmethod
    def inputs(seed=0):
        g = generator(seed)
        return (torch.randn(2, 3, generator=g, requires_grad=True), torch.randn(3, 3, generator=g, requires_grad=True))

    @staticmethod
    def program(x, w):
        return block(x, w).sum(-1)

    @staticmethod
    def reference(x, w):
        return (torch.relu(x @ w) + x).sum(-1)

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[2, 3]", w_1: "f32[3, 3]"):
        block_body_0 = self.block_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(block_body_0, x_1, w_1, hops.ScopeSpec('block'))
        getitem: "f32[2, 3]" = hops_named_scope[0]
        sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(getitem, [-1])
        return sum_1
    class block_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]"):
            mm: "f32[2, 3]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            relu: "f32[2, 3]" = torch.ops.aten.relu.default(mm)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(relu, arg0_1)
            return (add,)
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", primals_2: "f32[3, 3]"):
        block_body_0 = self.block_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(block_body_0, primals_1, primals_2, hops.ScopeSpec('block'))
        getitem: "f32[2, 3]" = hops_named_scope[0]
        getitem_1: "f32[2, 3]" = hops_named_scope[1]
        sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(getitem, [-1])
        return (sum_1, primals_1, primals_2, getitem_1)
    class block_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]"):
            mm: "f32[2, 3]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            relu: "f32[2, 3]" = torch.ops.aten.relu.default(mm)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(relu, arg0_1)
            return (add, relu)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", primals_2: "f32[3, 3]", getitem_1: "f32[2, 3]", tangents_1: "f32[2]"):
        unsqueeze: "f32[2, 1]" = torch.ops.aten.unsqueeze.default(tangents_1, -1)
        expand: "f32[2, 3]" = torch.ops.aten.expand.default(unsqueeze, [2, 3])
        block_bwd_body_0 = self.block_bwd_body_0
        hops_named_scope_1 = torch.ops.higher_order.hops_named_scope(block_bwd_body_0, primals_1, primals_2, getitem_1, expand, hops.ScopeSpec('block/bwd'))
        getitem_2: "f32[2, 3]" = hops_named_scope_1[0]
        getitem_3: "f32[3, 3]" = hops_named_scope_1[1]
        return (getitem_2, getitem_3)
    class block_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]", arg2_1: "f32[2, 3]", arg3_1: "f32[2, 3]"):
            threshold_backward: "f32[2, 3]" = torch.ops.aten.threshold_backward.default(arg3_1, arg2_1, 0)
            t: "f32[3, 2]" = torch.ops.aten.t.default(arg0_1)
            mm: "f32[3, 3]" = torch.ops.aten.mm.default(t, threshold_backward)
            t_1: "f32[3, 3]" = torch.ops.aten.t.default(arg1_1)
            mm_1: "f32[2, 3]" = torch.ops.aten.mm.default(threshold_backward, t_1)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(arg3_1, mm_1)
            return (add, mm)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[2, 3]", inputs_1: "f32[3, 3]"):
        block_body_0 = self.block_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(block_body_0, inputs_0, inputs_1, hops.ScopeSpec('block'))
        getitem: "f32[2, 3]" = hops_named_scope[0]
        sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(getitem, [-1])
        return (sum_1,)
    class block_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]"):
            matmul: "f32[2, 3]" = torch.ops.aten.matmul.default(arg0_1, arg1_1)
            relu: "f32[2, 3]" = torch.ops.aten.relu.default(matmul)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(relu, arg0_1)
            return (add,)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 3]", L_w_: "f32[3, 3]"):
        l_x_ = L_x_
        l_w_ = L_w_
        block_body_0 = self.block_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(block_body_0, l_x_, l_w_, (), hops.ScopeSpec('block'))
        getitem: "f32[2, 3]" = hops_named_scope[0]
        sum_1: "f32[2]" = getitem.sum(-1)
        return (sum_1,)
    class block_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[2, 3]", l_w_: "f32[3, 3]"):
            matmul: "f32[2, 3]" = l_x_ @ l_w_
            relu: "f32[2, 3]" = torch.relu(matmul)
            result: "f32[2, 3]" = relu + l_x_
            return (result,)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", primals_2: "f32[3, 3]"):
        block_body_0 = self.block_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(block_body_0, primals_1, primals_2, hops.ScopeSpec('block'))
        getitem: "f32[2, 3]" = hops_named_scope[0]
        getitem_1: "f32[2, 3]" = hops_named_scope[1]
        sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(getitem, [-1])
        return (sum_1, primals_1, primals_2, getitem_1)
    class block_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]"):
            mm: "f32[2, 3]" = torch.ops.aten.mm.default(arg0_1, arg1_1)
            relu: "f32[2, 3]" = torch.ops.aten.relu.default(mm)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(relu, arg0_1)
            return (add, relu)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", primals_2: "f32[3, 3]", getitem_1: "f32[2, 3]", tangents_1: "f32[2]"):
        unsqueeze: "f32[2, 1]" = torch.ops.aten.unsqueeze.default(tangents_1, -1)
        expand: "f32[2, 3]" = torch.ops.aten.expand.default(unsqueeze, [2, 3])
        block_bwd_body_0 = self.block_bwd_body_0
        hops_named_scope_1 = torch.ops.higher_order.hops_named_scope(block_bwd_body_0, primals_1, primals_2, getitem_1, expand, hops.ScopeSpec('block/bwd'))
        getitem_2: "f32[2, 3]" = hops_named_scope_1[0]
        getitem_3: "f32[3, 3]" = hops_named_scope_1[1]
        return (getitem_2, getitem_3)
    class block_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3]", arg1_1: "f32[3, 3]", arg2_1: "f32[2, 3]", arg3_1: "f32[2, 3]"):
            threshold_backward: "f32[2, 3]" = torch.ops.aten.threshold_backward.default(arg3_1, arg2_1, 0)
            t: "f32[3, 2]" = torch.ops.aten.t.default(arg0_1)
            mm: "f32[3, 3]" = torch.ops.aten.mm.default(t, threshold_backward)
            t_1: "f32[3, 3]" = torch.ops.aten.t.default(arg1_1)
            mm_1: "f32[2, 3]" = torch.ops.aten.mm.default(threshold_backward, t_1)
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(arg3_1, mm_1)
            return (add, mm)
""")


# --------------------------------------------------------------------------- kernel


def _scaled_cube_backward(x, out, grad, *, scale):
    return grad * scale * 3 * x * x


@hops.kernel(abstract=lambda x, *, scale: torch.empty_like(x), backward=_scaled_cube_backward)
def scaled_cube(x, *, scale=1.0):
    return scale * x * x * x


class Kernel(Sample):
    name = "kernel"
    hop = scaled_cube

    @staticmethod
    def inputs(seed=0):
        return (torch.randn(2, 3, generator=generator(seed), requires_grad=True),)

    @staticmethod
    def program(x):
        return scaled_cube(x, scale=2.0) + x

    @staticmethod
    def reference(x):
        return 2.0 * x * x * x + x

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[2, 3]"):
        hops_kernel_scaled_cube: "f32[2, 3]" = torch.ops.higher_order.hops_kernel_scaled_cube(x_1, hops.KernelParams.of(scale=2.0))
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(hops_kernel_scaled_cube, x_1)
        return add
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]"):
        hops_kernel_scaled_cube: "f32[2, 3]" = torch.ops.higher_order.hops_kernel_scaled_cube(primals_1, hops.KernelParams.of(scale=2.0))
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(hops_kernel_scaled_cube, primals_1)
        return (add, primals_1)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", tangents_1: "f32[2, 3]"):
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(tangents_1, 2.0)
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul, 3)
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul_1, primals_1)
        mul_3: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul_2, primals_1)
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(tangents_1, mul_3)
        return (add_1,)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[2, 3]"):
        hops_kernel_scaled_cube: "f32[2, 3]" = torch.ops.higher_order.hops_kernel_scaled_cube(inputs_0, hops.KernelParams.of(scale=2.0))
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(hops_kernel_scaled_cube, inputs_0)
        return (add,)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 3]"):
        l_x_ = L_x_
        hops_kernel_scaled_cube: "f32[2, 3]" = torch.ops.higher_order.hops_kernel_scaled_cube(l_x_, hops.KernelParams.of(scale=2.0))
        add: "f32[2, 3]" = hops_kernel_scaled_cube + l_x_
        return (add,)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]"):
        hops_kernel_scaled_cube: "f32[2, 3]" = torch.ops.higher_order.hops_kernel_scaled_cube(primals_1, hops.KernelParams.of(scale=2.0))
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(hops_kernel_scaled_cube, primals_1)
        return (add, primals_1)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3]", tangents_1: "f32[2, 3]"):
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(tangents_1, 2.0)
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul, 3)
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul_1, primals_1)
        mul_3: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul_2, primals_1)
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(tangents_1, mul_3)
        return (add_1,)
""")


# --------------------------------------------------------------------------- einsum


class Einsum(Sample):
    name = "einsum"
    hop = hops.einsum_kernel

    @staticmethod
    def inputs(seed=0):
        g = generator(seed)
        return (torch.randn(2, 3, 4, generator=g, requires_grad=True), torch.randn(4, 5, generator=g, requires_grad=True))

    @staticmethod
    def program(x, w):
        return hops.einsum("bsd,df->bsf", x, w)

    @staticmethod
    def reference(x, w):
        return torch.einsum("bsd,df->bsf", x, w)

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[2, 3, 4]", w_1: "f32[4, 5]"):
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(x_1, w_1, hops.KernelParams.of(equation='bsd,df->bsf'))
        return hops_kernel_einsum
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[4, 5]"):
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(primals_1, primals_2, hops.KernelParams.of(equation='bsd,df->bsf'))
        return (hops_kernel_einsum, primals_1, primals_2)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[4, 5]", tangents_1: "f32[2, 3, 5]"):
        hops_kernel_einsum_1: "f32[2, 3, 4]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_2, hops.KernelParams.of(equation='bsf,df->bsd'))
        hops_kernel_einsum_2: "f32[4, 5]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_1, hops.KernelParams.of(equation='bsf,bsd->df'))
        return (hops_kernel_einsum_1, hops_kernel_einsum_2)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[2, 3, 4]", inputs_1: "f32[4, 5]"):
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(inputs_0, inputs_1, hops.KernelParams.of(equation='bsd,df->bsf'))
        return (hops_kernel_einsum,)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 3, 4]", L_w_: "f32[4, 5]"):
        l_x_ = L_x_
        l_w_ = L_w_
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(l_x_, l_w_, hops.KernelParams.of(equation='bsd,df->bsf'))
        return (hops_kernel_einsum,)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[4, 5]"):
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(primals_1, primals_2, hops.KernelParams.of(equation='bsd,df->bsf'))
        return (hops_kernel_einsum, primals_1, primals_2)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[4, 5]", tangents_1: "f32[2, 3, 5]"):
        hops_kernel_einsum_1: "f32[2, 3, 4]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_2, hops.KernelParams.of(equation='bsf,df->bsd'))
        hops_kernel_einsum_2: "f32[4, 5]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_1, hops.KernelParams.of(equation='bsf,bsd->df'))
        return (hops_kernel_einsum_1, hops_kernel_einsum_2)
""")


class EinsumLinear(Sample):
    name = "einsum_linear"
    hop = hops.einsum_linear_kernel

    @staticmethod
    def inputs(seed=0):
        g = generator(seed)
        return (
            torch.randn(2, 3, 4, generator=g, requires_grad=True),
            torch.randn(5, 4, generator=g, requires_grad=True),
            torch.randn(5, generator=g, requires_grad=True),
        )

    @staticmethod
    def program(x, weight, bias):
        return hops.einsum_linear(x, weight, bias)

    @staticmethod
    def reference(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    # ---- snapshots (filled with EXPECTTEST_ACCEPT=1; one string holds on every torch version)

    def snapshot_make_fx_fake(t, text):
        t.assertExpectedInline(text, """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[2, 3, 4]", weight_1: "f32[5, 4]", bias_1: "f32[5]"):
        hops_kernel_einsum_linear: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum_linear(x_1, weight_1, bias_1, hops.KernelParams.of())
        return hops_kernel_einsum_linear
""")

    def snapshot_aot(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[5, 4]", primals_3: "f32[5]"):
        hops_kernel_einsum_linear: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum_linear(primals_1, primals_2, primals_3, hops.KernelParams.of())
        return (hops_kernel_einsum_linear, primals_1, primals_2)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[5, 4]", tangents_1: "f32[2, 3, 5]"):
        hops_kernel_einsum: "f32[2, 3, 4]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_2, hops.KernelParams.of(equation='...o,oi->...i'))
        hops_kernel_einsum_1: "f32[5, 4]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_1, hops.KernelParams.of(equation='...o,...i->oi'))
        hops_kernel_einsum_2: "f32[5]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, hops.KernelParams.of(equation='...o->o'))
        return (hops_kernel_einsum, hops_kernel_einsum_1, hops_kernel_einsum_2)
""")

    def snapshot_export_strict(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, inputs_0: "f32[2, 3, 4]", inputs_1: "f32[5, 4]", inputs_2: "f32[5]"):
        hops_kernel_einsum_linear: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum_linear(inputs_0, inputs_1, inputs_2, hops.KernelParams.of())
        return (hops_kernel_einsum_linear,)
""")

    def snapshot_dynamo(t, text):
        t.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 3, 4]", L_weight_: "f32[5, 4]", L_bias_: "f32[5]"):
        l_x_ = L_x_
        l_weight_ = L_weight_
        l_bias_ = L_bias_
        hops_kernel_einsum_linear: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum_linear(l_x_, l_weight_, l_bias_, hops.KernelParams.of())
        return (hops_kernel_einsum_linear,)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[5, 4]", primals_3: "f32[5]"):
        hops_kernel_einsum_linear: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum_linear(primals_1, primals_2, primals_3, hops.KernelParams.of())
        return (hops_kernel_einsum_linear, primals_1, primals_2)
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[5, 4]", tangents_1: "f32[2, 3, 5]"):
        hops_kernel_einsum: "f32[2, 3, 4]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_2, hops.KernelParams.of(equation='...o,oi->...i'))
        hops_kernel_einsum_1: "f32[5, 4]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_1, hops.KernelParams.of(equation='...o,...i->oi'))
        hops_kernel_einsum_2: "f32[5]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, hops.KernelParams.of(equation='...o->o'))
        return (hops_kernel_einsum, hops_kernel_einsum_1, hops_kernel_einsum_2)
""")


SAMPLES = [Annotation, LocalMap, Scan, NamedScope, Kernel, Einsum, EinsumLinear]
