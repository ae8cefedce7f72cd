"""Every HOP of this package has a row in every per-HOP table: each lowering target, the
solver's view of it (``placement_graph``, the shapes of its results), ``check_placements``,
``format_placements`` and the inductor lowering. Tables and HOPs are both found from their
registries (``passes._infra.hop_tables``, torch's HOP registry), never from a list kept here,
so a new HOP or a new table cannot be missed."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import ShardingSpec
from hops._body_hop.base import BodyHOP
from passes._infra import hop_tables, is_package_hop, missing_rows, ordinary_op
from tests.helpers.hop_db import MESH, ROWS


@hops.kernel(abstract=lambda x: torch.empty_like(x))
def doubled_for_tables(x):
    return x * 2


def package_hops() -> list:
    """Every HOP of this package that exists now (kernels defined by tests included)."""
    return [
        hop
        for hop in torch._ops._higher_order_ops.values()
        if is_package_hop(hop) and not hop.__name__.startswith("hops_test_")
    ]


class Forgotten(BodyHOP):
    """A HOP nobody gave rows to."""

    spec_type = ShardingSpec

    def __init__(self):
        super().__init__("hops_test_forgotten")


forgotten = Forgotten()


def test_every_hop_has_a_row_in_every_table():
    hops_now = package_hops()
    names = {hop.__name__ for hop in hops_now}
    assert {"hops_sharding_annotation", "hops_local_map", "hops_scan", "hops_named_scope", "hops_kernel_einsum"} <= names
    assert doubled_for_tables in hops_now  # a kernel defined after import is a HOP too
    assert missing_rows(hops_now) == []


def test_the_registry_finds_every_table():
    tables = set(hop_tables())
    assert {
        "target 'inline'", "target 'xla'", "target 'dtensor'", "target 'unroll'",
        "solver view", "solver shapes", "check_placements", "format_placements", "inductor",
    } <= tables


def test_a_hop_without_rows_is_named_with_each_table_it_misses():
    missing = missing_rows([forgotten])
    assert sorted(table for table, _ in missing) == sorted(hop_tables())
    assert {hop for _, hop in missing} == {"hops_test_forgotten"}


def test_a_table_missing_a_row_is_found():
    table = passes._infra.hop_table("test partial table")
    try:
        table[hops.scan_hop] = ordinary_op
        missing = missing_rows(package_hops())
        assert ("test partial table", "hops_local_map") in missing
        assert ("test partial table", "hops_scan") not in missing
        assert ("test partial table", doubled_for_tables.__name__) in missing
    finally:
        del passes._infra.HOP_TABLES["test partial table"]
    assert missing_rows(package_hops()) == []


def test_the_solver_refuses_a_hop_without_a_row_naming_it_and_the_table():
    gm = make_fx(lambda x: x * 2)(torch.randn(4, 4))
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    with gm.graph.inserting_after(mul):
        call = gm.graph.call_function(forgotten, (mul, ROWS))
    call.meta["val"] = mul.meta["val"]
    next(iter(gm.graph.find_nodes(op="output"))).args = (call,)
    gm.recompile()
    with pytest.raises(passes.PassError, match=r"placement_graph: no 'solver view' row for .*hops_test_forgotten"):
        passes.placement_graph(gm, MESH)
    with pytest.raises(passes.PassError, match=r"check_placements: no 'check_placements' row for .*hops_test_forgotten"):
        passes.check_placements(gm)
