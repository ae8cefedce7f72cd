"""A HOP body copied into its caller by a pass (``passes._infra.copy_body_into``: inlining, the
DTensor lowering) keeps reading its own tensor constants, also where the caller has another
constant under the same name (both graphs number theirs from ``_tensor_constant0``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard

MESH = Mesh.of(data=2, model=2)
ROWS = (Shard(0), Replicate())
OUTER, INNER, SECOND = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor(-5.0), torch.tensor([0.5, 0.25, 2.0, 4.0])


def with_body_constants(gm: torch.fx.GraphModule, constants: list[torch.Tensor]) -> None:
    """Each HOP body of ``gm`` multiplies its output by its own constants, read by ``get_attr``
    under the names the caller's constants have (``_tensor_constant<i>``)."""
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not isinstance(getattr(gm, node.target), torch.fx.GraphModule):
            continue
        body = getattr(gm, node.target)
        (output,) = body.graph.find_nodes(op="output")
        (value,) = output.args[0]
        with body.graph.inserting_before(output):
            for i, constant in enumerate(constants):
                body.register_buffer(f"_tensor_constant{i}", constant.clone())
                value = body.graph.call_function(torch.ops.aten.mul.Tensor, (value, body.graph.get_attr(f"_tensor_constant{i}")))
        output.args = ((value,),)
        body.recompile()


@pytest.mark.parametrize("hop", ["local_map", "named_scope"])
def test_an_inlined_body_reads_its_own_constants(hop):
    body = lambda x: torch.tanh(x)  # noqa: E731
    wrapped = hops.local_map(body, mesh=MESH, in_placements=(ROWS,), out_placements=ROWS) if hop == "local_map" else hops.named_scope("s")(body)

    def program(x):
        return wrapped(x * OUTER) + SECOND

    x = torch.randn(4, 4)
    gm = make_fx(program)(x)
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} >= {"_tensor_constant0", "_tensor_constant1"}
    with_body_constants(gm, [INNER, INNER * 2])
    expected = torch.tanh(x * OUTER) * INNER * (INNER * 2) + SECOND
    torch.testing.assert_close(gm(x), expected)  # as traced, before any pass
    inlined = passes.inline_hops(copy.deepcopy(gm))
    torch.testing.assert_close(inlined(x), expected)
