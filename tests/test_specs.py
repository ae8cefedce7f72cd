"""Typed spec values: value semantics, conversions, and the errors bad input gets."""

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
import torch.fx as fx

import hops
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec

MESH = Mesh((2, 2), ("data", "model"))
SPEC = ShardingSpec(MESH, (Shard(0), Replicate()))

VALUES = [
    MESH,
    Mesh((4,), ("x",), device_ids=(3, 2, 1, 0)),
    Shard(1),
    Replicate(),
    Partial(),
    Partial("max"),
    SPEC,
    ShardingSpec(MESH, (Shard(0), Replicate()), (Partial(), Shard(1))),
    ShardingSpec(Mesh((4,), ("x",)), (Partial("avg"),)),
    hops.LocalMapSpec(MESH, ((Shard(0), Replicate()), None, (Partial(), Partial("max"))), ((Shard(1), Shard(0)),)),
    hops.LocalMapSpec(MESH, ((Replicate(), Replicate()),), ((Shard(0), Replicate()),), ((Partial(), Partial()),)),
    hops.ScanSpec(2, 1, length=5, reverse=True, remat=True, unroll=2),
    hops.ScopeSpec("layer0/attention"),
    hops.KernelParams.of(block=128, dtype=torch.bfloat16, spec=SPEC),
]


@pytest.mark.parametrize(
    "value, text",
    [
        (SPEC, "hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R')"),
        (Mesh((4,), ("x",), device_ids=(3, 2, 1, 0)), "hops.Mesh.of((3, 2, 1, 0), x=4)"),
        (ShardingSpec(MESH, "PP(max)", "RS(1)"), "hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'PP(max)', 'RS(1)')"),
        (hops.LocalMapSpec(MESH, "S(0)R, -", "RR"), "hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, -', 'RR')"),
        (hops.ScanSpec(1, 1, length=4), "hops.ScanSpec(1, 1, length=4)"),
    ],
)
def test_reprs_are_compact_python(value, text):
    # Placements print one token per mesh axis (S(d), R, P, P(op)); a mesh by its axes.
    assert repr(value) == text
    assert eval(text, {"hops": hops}) == value


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_value_semantics(value):
    twin = eval(repr(value), {"hops": hops, "torch": torch})
    assert twin == value and hash(twin) == hash(value)
    assert pickle.loads(pickle.dumps(value)) == value
    assert copy.deepcopy(value) == value
    assert hops.spec_from_text(repr(value)) == value
    field = next(iter(value.__dataclass_fields__), None)
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)


def test_equality_is_by_value_and_kind():
    assert Shard(0) != Shard(1)
    assert Replicate() != Partial()
    assert Mesh((4,), ("x",)) == Mesh([4], ["x"], device_ids=np.arange(4))
    assert Mesh((2, 2), ("a", "b"), device_ids=[[0, 1], [2, 3]]) == Mesh((2, 2), ("a", "b"))
    assert Mesh((4,), ("x",)) != Mesh((4,), ("y",))
    assert len({SPEC, ShardingSpec(MESH, (Shard(0), Replicate())), ShardingSpec(MESH, (Replicate(), Shard(0)))}) == 2


def test_fx_keeps_spec_as_a_literal_constant():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, 1), {"alpha": 1}))
    tracer = fx.Tracer()
    assert tracer.create_arg(SPEC) is SPEC  # not a constructor node
    node = graph.call_function(hops.sharding_annotation_hop, (x, SPEC))
    assert node.args[1] is SPEC


def test_partition_spec_round_trip():
    assert SPEC.to_partition_spec(2) == ("data", None)
    both = ShardingSpec(MESH, (Shard(1), Shard(1)))
    assert both.to_partition_spec(3) == (None, ("data", "model"), None)
    assert ShardingSpec.from_partition_spec(MESH, (None, ("data", "model"), None)) == both
    assert ShardingSpec.from_partition_spec(MESH, ("model", None)) == ShardingSpec(
        MESH, (Replicate(), Shard(0))
    )
    assert ShardingSpec(MESH, (Replicate(), Replicate())).to_partition_spec(0) == ()


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_negative_shard_dims_count_from_the_last_dim_as_in_dtensor(rank):
    for dim in range(-rank, 0):
        spec = ShardingSpec(MESH, (Shard(dim), Replicate()))
        resolved = ShardingSpec(MESH, (Shard(dim + rank), Replicate()))
        assert spec.for_rank(rank, "x") == resolved
        assert spec.to_partition_spec(rank) == resolved.to_partition_spec(rank)
        assert eval(repr(spec), {"hops": hops}) == spec  # the text form keeps the sign
    assert resolved.for_rank(rank, "x") is resolved


def test_dtensor_placements_convert_both_ways():
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    spec = ShardingSpec(MESH, (DShard(1), DPartial("max")))
    assert spec == ShardingSpec(MESH, (Shard(1), Partial("max")))
    assert spec.to_dtensor_placements() == (DShard(1), DPartial("max"))
    assert hops.Placement.from_dtensor(DReplicate()) == Replicate()
    assert hops.Placement.from_dtensor(DShard(-1)) == Shard(-1)


def test_mesh_to_device_mesh_with_fake_process_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with pytest.raises(RuntimeError, match="process group"):
        MESH.to_device_mesh()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        device_mesh = MESH.to_device_mesh()
        assert device_mesh.mesh_dim_names == ("data", "model")
        assert device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert Mesh.from_device_mesh(device_mesh) == MESH
        with pytest.raises(ValueError, match="world size 4"):
            Mesh((8,), ("x",)).to_device_mesh()
    finally:
        dist.destroy_process_group()


@pytest.mark.xla
def test_mesh_and_spec_to_torch_xla_and_back():
    import torch_xla.distributed.spmd as xs

    xla_mesh = MESH.to_xla()
    assert isinstance(xla_mesh, xs.Mesh)
    assert xla_mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    assert Mesh.from_xla(xla_mesh) == MESH
    reordered = Mesh((2, 2), ("data", "model"), device_ids=(3, 1, 2, 0))
    assert Mesh.from_xla(reordered.to_xla()) == reordered
    spec = ShardingSpec(reordered, (Shard(1), Shard(1)))
    xla_mesh, partition_spec = spec.to_xla(3)
    assert partition_spec == (None, ("data", "model"), None)
    assert ShardingSpec.from_xla(xla_mesh, partition_spec) == spec
    assert ShardingSpec.from_xla(xla_mesh, (None, (0, 1), None)) == spec
    assert ShardingSpec.from_xla(xla_mesh, (1, None)) == ShardingSpec(reordered, (Replicate(), Shard(0)))


# ----------------------------------------------------------------------------- bad calls

BAD_CALLS = [
    ("mesh shape not a sequence", lambda: Mesh(4, ("x",)), TypeError, r"Mesh\(shape=...\)"),
    ("mesh shape has zero", lambda: Mesh((0, 2), ("a", "b")), ValueError, r"Mesh\(shape=...\)\[0\] must be >= 1"),
    ("mesh shape not ints", lambda: Mesh((2.0, 2), ("a", "b")), TypeError, r"Mesh\(shape=...\)\[0\] must be an int"),
    ("mesh without axes", lambda: Mesh((), ()), ValueError, "at least one axis"),
    ("axis names count", lambda: Mesh((2, 2), ("a",)), ValueError, r"has 1 names .* 2 axes"),
    ("axis names as one str", lambda: Mesh((2,), "ab"), TypeError, r"axis_names=...\) must be a sequence"),
    ("axis name not identifier", lambda: Mesh((2,), ("",)), TypeError, r"axis_names=...\)\[0\]"),
    ("duplicate axis names", lambda: Mesh((2, 2), ("a", "a")), ValueError, "duplicate names"),
    ("device id count", lambda: Mesh((2, 2), ("a", "b"), device_ids=(0, 1, 2)), ValueError, "3 ids but shape"),
    ("device ids shape", lambda: Mesh((2, 2), ("a", "b"), device_ids=np.arange(4).reshape(4, 1)), ValueError, r"device_ids=...\) has shape \(4, 1\)"),
    ("duplicate device ids", lambda: Mesh((2,), ("a",), device_ids=(1, 1)), ValueError, "duplicate ids"),
    ("negative device id", lambda: Mesh((2,), ("a",), device_ids=(0, -1)), ValueError, "device_ids"),
    ("shard dim below -rank", lambda: ShardingSpec(MESH, (Shard(-3), Replicate())).for_rank(2, "x"), ValueError, r"x: placement hops.Shard\(-3\) on mesh axis 'data' shards dim -3, but the tensor has rank 2"),
    ("shard dim at rank", lambda: ShardingSpec(MESH, (Shard(2), Replicate())).to_partition_spec(2), ValueError, "shards dim 2, but the tensor has rank 2"),
    ("shard dim not int", lambda: Shard("0"), TypeError, r"Shard\(dim\) must be an int"),
    ("unknown partial op", lambda: Partial("mean"), ValueError, r"Partial\(reduce_op\)"),
    ("spec mesh not a Mesh", lambda: ShardingSpec(("data",), (Shard(0),)), TypeError, r"ShardingSpec\(mesh=...\)"),
    ("placements count", lambda: ShardingSpec(MESH, (Shard(0),)), ValueError, "1 placements but the mesh has 2 axes"),
    ("placement not a placement", lambda: ShardingSpec(MESH, ("S0", Replicate())), TypeError, r"placements=...\)\[0\]"),
    ("placements a single placement", lambda: ShardingSpec(MESH, Shard(0)), TypeError, "one placement per mesh axis"),
    ("partition spec for partial", lambda: ShardingSpec(MESH, (Partial(), Shard(0))).to_partition_spec(2), ValueError, "Partial placement"),
    ("partition spec rank", lambda: ShardingSpec(MESH, (Shard(2), Replicate())).to_partition_spec(2), ValueError, "has rank 2"),
    ("partition spec unknown axis", lambda: ShardingSpec.from_partition_spec(MESH, ("batch", None)), ValueError, "unknown mesh axis 'batch'"),
    ("partition spec axis twice", lambda: ShardingSpec.from_partition_spec(MESH, ("data", "data")), ValueError, "uses mesh axis 'data' twice"),
    ("partition spec a str", lambda: ShardingSpec.from_partition_spec(MESH, "data"), TypeError, "one entry per tensor dim"),
    ("spec text not a spec", lambda: hops.spec_from_text("__import__('os')"), ValueError, "not a spec"),
    ("dtensor placement of other kind", lambda: hops.Placement.from_dtensor(object()), TypeError, "cannot convert"),
    ("placements text unreadable", lambda: ShardingSpec(MESH, "S(0)Q"), ValueError, r"cannot read placements 'S\(0\)Q' at 'Q'"),
    ("placements text shard without dim", lambda: ShardingSpec(MESH, "SR"), ValueError, r"Shard needs a dim"),
    ("gradient placements count", lambda: ShardingSpec(MESH, "S(0)R", "R"), ValueError, r"grad_placements=...\) has 1 placements"),
    ("local_map spec text count", lambda: hops.LocalMapSpec(MESH, "S(0)", "RR"), ValueError, r"in_placements\[0\] has 1 placements"),
]


@pytest.mark.parametrize("what,call,error,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_clear_errors(what, call, error, message):
    with pytest.raises(error, match=message):
        call()

