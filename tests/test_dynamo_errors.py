"""Under torch.compile this package's typed errors are what eager raises, whichever path
brought them into Dynamo (a HOP's checks run by its variable, its fake rule run on the node,
the body raising while Dynamo traces it, this package's Python raising while Dynamo traces
it): without ``fullgraph`` the same class and message; with ``fullgraph`` Dynamo's own
``Unsupported`` naming that class and message (importing the package changes no Dynamo
function to raise another exception in its place)."""

from __future__ import annotations

import re

import pytest
import torch

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from hops._body_hop.body import BodyMutationError
from hops.local_map import LocalMapArgumentError
from hops.scan import ScanArgumentError, ScanDimError

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ((Shard(0), Replicate()),)


@hops.kernel(abstract=lambda x, *, sizes: torch.empty_like(x))
def resized(x, *, sizes):
    return x.clone()


def writes_its_input(a):
    a.add_(1)
    return a * 2


def inner_none(a):
    return None


def writes_its_input_dict(args):
    args["w"].add_(1)
    return args["w"] * 2


def grows_h(carry, x):
    return {"h": torch.cat([carry["h"], x["w"]]), "k": carry["k"]}, x["w"]


# (name, the public function whose call fails, bad program of x: float32[8, 4], expected
# class, message regex). Every message starts with its function's one prefix and names
# leaves by key path (tests/test_error_messages.py holds every case to that).
BAD_PROGRAMS = [
    (
        "annotation spec given as a string",
        "annotate_sharding",
        lambda x: hops.annotate_sharding(x, "S(0)R"),
        TypeError,
        r"^annotate_sharding: spec must be a hops.ShardingSpec, got str 'S\(0\)R'",
    ),
    (
        "Shard dim out of range",
        "annotate_sharding",
        lambda x: hops.annotate_sharding(x, ShardingSpec(MESH, (Shard(5), Replicate()))),
        ValueError,
        r"^annotate_sharding: spec: placement hops.Shard\(5\) on mesh axis 'data' shards dim 5, but the tensor has rank 2",
    ),
    (
        "uneven local_map shard",
        "local_map",
        lambda x: hops.local_map(lambda a: a + 1, mesh=MESH, in_placements=ROWS, out_placements=ROWS)(x[:7]),
        ValueError,
        r"^local_map\(lambda\): args\[0\] \(in_placements\[0\]\): dim 0 has size 7, which does not split evenly over mesh axes \['data'\]",
    ),
    (
        "uneven local_map shard of a dict leaf",
        "local_map",
        lambda x: hops.local_map(lambda a: a["w"] + 1, mesh=MESH, in_placements=({"w": ROWS[0]},), out_placements=ROWS)({"w": x[:7]}),
        ValueError,
        r"^local_map\(lambda\): args\[0\]\['w'\] \(in_placements\[0\]\['w'\]\): dim 0 has size 7, which does not split evenly",
    ),
    (
        "local_map body returning more outputs than out_placements",
        "local_map",
        lambda x: hops.local_map(lambda a: (a + 1, a + 2), mesh=MESH, in_placements=ROWS, out_placements=ROWS)(x),
        LocalMapArgumentError,
        r"^local_map\(lambda\): returned .* which does not match out_placements: 1 placements for 2 outputs",
    ),
    (
        "local_map body writing into its input",
        "local_map",
        lambda x: hops.local_map(writes_its_input, mesh=MESH, in_placements=ROWS, out_placements=ROWS)(x),
        BodyMutationError,
        r"^local_map\(writes_its_input\): the body writes into its input args\[0\] in place",
    ),
    (
        "local_map body writing into a dict leaf",
        "local_map",
        lambda x: hops.local_map(writes_its_input_dict, mesh=MESH, in_placements=({"w": ROWS[0]},), out_placements=ROWS)({"w": x}),
        BodyMutationError,
        r"^local_map\(writes_its_input_dict\): the body writes into its input args\[0\]\['w'\] in place",
    ),
    (
        "scan carry changing shape",
        "scan",
        lambda x: hops.scan(lambda c, xi: (torch.cat([c, xi]), xi), x[0], x),
        TypeError,
        r"^scan\(lambda\): the carry at init changes from \(4,\) torch.float32 to \(8,\) torch.float32 in one step",
    ),
    (
        "scan carry leaf in a dict changing shape",
        "scan",
        lambda x: hops.scan(grows_h, {"h": x[0], "k": x[1]}, {"w": x}),
        TypeError,
        r"^scan\(grows_h\): the carry at init\['h'\] changes from \(4,\) torch.float32 to \(8,\)",
    ),
    (
        "scan xs leaves of different lengths",
        "scan",
        lambda x: hops.scan(grows_h, {"h": x[0], "k": x[1]}, {"w": x, "b": x[:3]}),
        ValueError,
        r"^scan\(grows_h\): xs\['b'\] has length 3 but xs\['w'\] has 8 along dim 0",
    ),
    (
        "scan xs leaf that is not a tensor",
        "scan",
        lambda x: hops.scan(grows_h, {"h": x[0], "k": x[1]}, [x, {"w": 3}]),
        ScanArgumentError,
        r"^scan\(grows_h\): xs\[1\]\['w'\] is a int, not a tensor",
    ),
    (
        "scan dim an xs leaf lacks",
        "scan",
        lambda x: hops.scan(lambda c, xi: (c, xi), x[0], (x, x[0]), dim=1),
        ScanDimError,
        r"^scan\(lambda\): dim=1 but xs\[1\] has shape \(4,\)",
    ),
    (
        "kernel param given as a list",
        "kernel",
        lambda x: resized(x, sizes=[1, 2]),
        TypeError,
        r"^kernel\(resized\): param sizes is a list \(\[1, 2\]\), which is not hashable; pass a tuple",
    ),
    (
        "einsum operand of the wrong rank",
        "einsum",
        lambda x: hops.einsum("ij,jk->ik", x, x[0]),
        ValueError,
        r"^einsum\('ij,jk->ik'\): operands\[1\] has rank 1, but its subscripts 'jk' name 2 dims",
    ),
    (
        "einsum contracted sizes that differ",
        "einsum",
        lambda x: hops.einsum("ij,jk->ik", x, x),
        ValueError,
        r"^einsum\('ij,jk->ik'\): subscript 'j' has size 4 in operands\[0\] but 8 in operands\[1\]",
    ),
    (
        "named_scope body returning None",
        "named_scope",
        lambda x: hops.named_scope("block")(inner_none)(x),
        TypeError,
        r"^named_scope\(inner_none\): returned NoneType, expected a Tensor or a pytree of Tensors \(scope 'block'\)",
    ),
    (
        "named_scope body writing into a dict leaf",
        "named_scope",
        lambda x: hops.named_scope("block")(writes_its_input_dict)({"w": x}),
        BodyMutationError,
        r"^named_scope\(writes_its_input_dict\): the body writes into its input args\[0\]\['w'\] in place",
    ),
    (
        "a typed error inside a scan inside a named scope",
        "scan",
        lambda x: hops.named_scope("outer")(lambda a: hops.scan(lambda c, xi: (torch.cat([c, xi]), xi), a[0], a)[0])(x),
        TypeError,
        r"^scan\(lambda\): the carry at init changes from \(4,\) torch.float32 to \(8,\)",
    ),
]

RUNS = {
    "eager": lambda program: program,
    "fullgraph": lambda program: torch.compile(program, backend="eager", fullgraph=True),
    "graph_breaks": lambda program: torch.compile(program, backend="eager"),
}


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("name, function, program, expected, message", BAD_PROGRAMS, ids=[case[0] for case in BAD_PROGRAMS])
def test_a_typed_error_is_raised_as_in_eager(name, function, program, expected, message, run):
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        RUNS[run](program)(torch.randn(8, 4))
    with pytest.raises(Exception) as eager:
        program(torch.randn(8, 4))
    assert type(eager.value) is expected
    assert re.search(message, str(eager.value)), str(eager.value)
    if run == "fullgraph":
        from torch._dynamo.exc import Unsupported

        report = str(compiled.value)
        assert isinstance(compiled.value, Unsupported), f"{name}: {type(compiled.value).__name__}: {report}"
        assert expected.__name__ in report, report
        assert str(eager.value) in report or repr(eager.value) in report, report
        cause = compiled.value.__cause__  # where a HOP's rule raised it, the error itself
        if type(cause) is expected:
            assert str(cause) == str(eager.value), repr(cause)
    else:
        assert type(compiled.value) is type(eager.value), f"{name}: {type(compiled.value).__name__}: {compiled.value}"
        assert str(compiled.value) == str(eager.value)


def test_traced_code_catching_the_typed_error_compiles_without_fullgraph():
    # Without fullgraph the typed error is a graph break: the call runs eagerly, where the
    # caller's except clause catches it, as in eager.
    def program(x):
        try:
            return hops.annotate_sharding(x, ShardingSpec(MESH, (Shard(5), Replicate())))
        except ValueError:
            return x * 3

    torch._dynamo.reset()
    x = torch.randn(8, 4)
    torch.testing.assert_close(torch.compile(program, backend="eager")(x), x * 3)


def test_the_users_own_exception_keeps_dynamos_report():
    # An exception the user's own code raises under fullgraph gets Dynamo's report, as
    # this package's do.
    def program(x):
        raise KeyError("the user's own")

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(program, backend="eager", fullgraph=True)(torch.randn(2))
