"""What is known about a body travels with it as one frozen ``BodyRecord`` (``body.__hops__``,
``hops/_body_hop/body_record.py``), not as attributes set here and there."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops._body_hop.body_record import (
    BodyRecord,
    across_calls_key,
    body_record,
    is_known_functional,
    known_functional,
    plan_body,
    plan_body_key,
    set_trace_key,
    trace_key,
    traced_graph,
)
from hops._body_hop.flat_body import FlatBody, OptionBodies
from hops._body_hop.subgraph import named

ROOT = pathlib.Path(__file__).resolve().parent.parent


def step(c, x):
    return c + x, c * 2


def test_a_body_without_a_record_is_its_own_key_and_nothing_is_known():
    body = lambda x: x  # noqa: E731
    assert body_record(body) == BodyRecord()
    assert trace_key(body) is body
    assert across_calls_key(body) is None and plan_body_key(body) is None and traced_graph(body) is None
    assert not is_known_functional(body)


def test_the_record_is_frozen_and_replaced_when_something_is_learned():
    body = lambda x: x  # noqa: E731
    set_trace_key(body, step, 1)
    first = body.__hops__
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.known_functional = True
    assert known_functional(body) is body
    assert body.__hops__ is not first and body.__hops__ == dataclasses.replace(first, known_functional=True)
    assert trace_key(body) == (step, 1)
    assert across_calls_key(body) is not None  # step's code and globals have a key


def test_an_unhashable_structure_leaves_no_key():
    body = lambda x: x  # noqa: E731
    set_trace_key(body, step, [1, 2])
    assert trace_key(body) is body and across_calls_key(body) is None


def test_across_calls_false_keeps_the_trace_key_only():
    body = lambda x: x  # noqa: E731
    set_trace_key(body, step, 1, across_calls=False)
    assert trace_key(body) == (step, 1) and across_calls_key(body) is None


def test_a_plan_body_is_known_functional_and_keyed_by_its_trace_key():
    body = plan_body(lambda x: x)
    assert is_known_functional(body) and plan_body_key(body) is body


def test_a_named_graph_module_is_reachable_as_its_traced_graph():
    graph = make_fx(lambda x: x.sin())(torch.ones(2))
    body = named(graph, "sine")
    assert body.__name__ == "sine" and traced_graph(body) is graph
    assert traced_graph(named(lambda x: x, "plain")) is None


def test_flat_and_option_bodies_carry_their_bodies_records():
    body = lambda x: (x, x)  # noqa: E731
    set_trace_key(body, step, 2)
    known_functional(body)
    flat = FlatBody(body)
    assert trace_key(flat) == (step, 2) and is_known_functional(flat)
    assert body_record(flat).code_key is body_record(body).code_key
    plain = FlatBody(lambda x: (x,))
    assert trace_key(plain) is plain.body

    plans = OptionBodies([plan_body(lambda x: (x,)), plan_body(lambda x: (x,))], active=1)
    assert trace_key(plans) is plans and is_known_functional(plans) and plan_body_key(plans) is plans
    mixed = OptionBodies([flat, plain], active=0)
    assert trace_key(mixed) == ((step, 2), plain.body)
    assert not is_known_functional(mixed) and across_calls_key(mixed) is None


def test_a_traced_scan_keeps_the_user_bodys_record_to_itself():
    # Equal calls in one trace share one inspection (the record's trace key), and the user's
    # own function is left as it was.
    def program(h, xs):
        return hops.scan(step, h, xs)

    gm = make_fx(program, tracing_mode="fake")(torch.zeros(3), torch.ones(4, 3))
    assert not hasattr(step, "__hops__")
    assert sum(1 for n in gm.graph.nodes if n.target is hops.scan_hop) == 1


# HOP-object flags and torch functions this package patches once: not bodies' records.
ALLOWED = {"hops_error_filter", "hops_specs", "hops_opaque", "hops_transparent"}


def _is_op_namespace(value: ast.expr) -> bool:
    """``torch.ops`` / ``torch.ops.higher_order``: ``torch.ops.hops_xla`` is a library, not state."""
    return isinstance(value, ast.Attribute) and value.attr in ("ops", "higher_order")


def test_no_body_state_travels_as_ad_hoc_hops_attributes():
    found = []
    for path in sorted([*(ROOT / "hops").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("hops_") and not _is_op_namespace(node.value):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("hops_")
            ):
                name = node.args[1].value
            if name is not None and name not in ALLOWED:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert found == []
