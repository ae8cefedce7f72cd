"""An int a HOP takes as an option (a scan's ``unroll`` or ``length``, a ``Shard(dim)`` of an
annotation or a ``local_map`` placement, a kernel's parameter) that changes between calls of
a compiled function is specialized, as torch does for an int an op needs static: Dynamo's
automatic dynamic shapes turns such an int into a symbol on the second call, and each
compile must still hold the call's own value in the node's spec (guarded on it), with
``fullgraph=True``, and compute what eager computes. A scan's ``length`` is the exception
the spec allows: it may stay symbolic (``ScanSpec.length`` None, one compile for every
length), as a symbolic xs length does."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec

MESH = Mesh((2, 2), ("data", "model"))


@hops.kernel(abstract=lambda x, *, times: torch.empty_like(x), backward=lambda x, out, grad, *, times: grad * times)
def scaled_by_option(x, *, times):
    return x * times


def _spec_holds(value, symbolic_length=False):
    """A predicate on a graph's HOP node args: some spec field or placement holds ``value``."""

    def found(node_args):
        for leaf in pytree.tree_leaves(node_args):
            if isinstance(leaf, hops.ScanSpec) and value in (leaf.unroll, leaf.length):
                return True
            if isinstance(leaf, hops.ScanSpec) and leaf.length is None and leaf.num_xs and symbolic_length:
                return True
            if isinstance(leaf, hops.KernelParams) and value in dict(leaf.items).values():
                return True
            text = repr(leaf)
            if isinstance(leaf, (hops.ShardingSpec, hops.LocalMapSpec)) and f"S({value})" in text:
                return True
        return False

    return found


# name -> (program factory of the int k, the k values to call with, inputs)
def _scan_unroll(k):
    def program(h, ws):
        return hops.scan(lambda c, w: (c + torch.tanh(c @ w), c.sum()), h, ws, unroll=k)

    return program


def _scan_length(k):
    def program(h, ws):
        return hops.scan(lambda c, _: (c * 2 + 1, c), h, None, length=k)

    return program


def _annotation(k):
    def program(h, ws):
        return hops.annotate_sharding(torch.tanh(h), ShardingSpec(MESH, (Shard(k), Replicate()))) * 2

    return program


def _local_map(k):
    body = hops.local_map(
        lambda x: torch.tanh(x) * 2,
        mesh=MESH,
        in_placements=((Shard(k), Replicate()),),
        out_placements=(Shard(k), Replicate()),
    )

    def program(h, ws):
        return body(h)

    return program


def _kernel(k):
    def program(h, ws):
        return scaled_by_option(h, times=k) + h

    return program


FACTORIES = {
    "scan unroll": (_scan_unroll, [1, 2, 3, 4]),
    "scan length": (_scan_length, [1, 2, 3, 5]),
    "annotation Shard(dim)": (_annotation, [0, 1]),
    "local_map Shard(dim)": (_local_map, [0, 1]),
    "kernel parameter": (_kernel, [1, 2, 3]),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g, requires_grad=True), (torch.randn(4, 4, 4, generator=g) / 4).requires_grad_()


def _run(name, values):
    factory, _ = FACTORIES[name]
    graphs, ran = [], []

    def capture(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            ran.append(gm)  # the compile this call used (a cache hit compiles nothing)
            return gm(*args)

        return run

    torch._dynamo.reset()
    for k in values:
        # A new function object each call over the same code: Dynamo's cache for that code
        # holds the earlier compiles, guarded on the int the closure held.
        program = factory(k)
        h, ws = _inputs()
        compiled = torch.compile(program, backend=capture, fullgraph=True)
        out = pytree.tree_leaves(compiled(h, ws))
        h_ref, ws_ref = _inputs()
        expected = pytree.tree_leaves(program(h_ref, ws_ref))
        for got, want in zip(out, expected, strict=True):
            torch.testing.assert_close(got, want)
        sum(o.sum() for o in out).backward()
        sum(o.sum() for o in expected).backward()
        torch.testing.assert_close(h.grad, h_ref.grad)
        hop_args = [n.args for n in ran[-1].graph.nodes if n.op == "call_function" and "hops_" in getattr(n.target, "__name__", "")]
        assert hop_args, f"{name}: no HOP node in the compiled graph"
        assert any(_spec_holds(k, name == "scan length")(args) for args in hop_args), f"{name}: k={k} not in the graph's spec: {hop_args}"
    return graphs


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_an_int_option_that_changes_is_specialized(name):
    values = FACTORIES[name][1]
    graphs = _run(name, values)
    if name != "scan length":  # one compile per value: each guarded on its own
        assert len(graphs) == len(set(values))


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_any_sequence_of_values_matches_eager(data):
    name = data.draw(st.sampled_from(sorted(FACTORIES)))
    values = data.draw(st.lists(st.sampled_from(FACTORIES[name][1]), min_size=2, max_size=4))
    _run(name, values)
