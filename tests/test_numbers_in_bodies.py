"""Bodies reading Python numbers (a module's ``eps``, a global scale, an int attribute), compiled.

Under ``torch.compile(dynamic=True)`` Dynamo lifts such numbers into a body as inputs: a float
as a 0-d tensor read back with ``item()`` (or, on some versions, as a plain float), an int as a
symbolic int. Every HOP with a body reads them as eager does, and inductor's loop for a scan
(torch's ``while_loop``, whose operands may only be tensors and ints) keeps them working.
"""

from __future__ import annotations

import pytest
import torch

import hops
from hops import Mesh, Replicate, Shard
from tests.helpers.hop_db import forward_backward, fresh

DIM = 8
SCALE = 0.5  # a global float the bodies read
NORM = torch.nn.LayerNorm(DIM, eps=1e-3)  # its eps (a float) and normalized_shape (ints)
MESH = Mesh((2, 2), ("data", "model"))


def normalized(h):
    return torch.nn.functional.layer_norm(h, NORM.normalized_shape, NORM.weight, NORM.bias, NORM.eps) * SCALE


def scan_program(h, ws):
    def step(c, w):
        c = normalized(c)
        return c + torch.tanh(c @ w), c.sum(-1) * NORM.eps

    last, ys = hops.scan(step, h, ws)
    return last.square().mean() + ys.mean()


def scope_program(h, ws):
    scoped = hops.named_scope("norm")(normalized)
    return (scoped(h) @ ws[0]).square().mean()


def region_program(h, ws):
    rows = (Shard(0), Replicate())
    region = hops.local_map(normalized, mesh=MESH, in_placements=(rows,), out_placements=(rows,))
    return (region(h) @ ws[0]).square().mean()


PROGRAMS = {"scan": scan_program, "named_scope": scope_program, "local_map": region_program}


# Inductor inlines the regions and scopes (aot_eager's graphs are what it receives); a scan is
# a loop of its own there. One compile per backend: a program running each of its HOPs' programs
# on inputs of its own, their values and gradients read apart.
CASES = {"aot_eager": ["scan", "named_scope", "local_map"], "inductor": ["scan"]}


@pytest.mark.parametrize("backend", CASES)
def test_numbers_a_body_reads_under_dynamic_shapes_give_eager_values(backend):
    names = CASES[backend]
    g = torch.Generator().manual_seed(0)
    inputs = [
        t
        for _ in names
        for t in (torch.randn(4, DIM, generator=g, requires_grad=True), (torch.randn(3, DIM, DIM, generator=g) / DIM).requires_grad_())
    ]

    def program(*inputs):
        return [PROGRAMS[name](*inputs[2 * i : 2 * i + 2]) for i, name in enumerate(names)]

    torch._dynamo.reset()
    got, got_grads = forward_backward(torch.compile(program, backend=backend, dynamic=True), fresh(inputs))
    expected, expected_grads = forward_backward(program, fresh(inputs))
    for i, name in enumerate(names):
        torch.testing.assert_close(got[i], expected[i], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(
            got_grads[2 * i : 2 * i + 2], expected_grads[2 * i : 2 * i + 2], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_a_float_operand_reaches_inductors_loop_as_a_constant_of_its_body():
    # The scan node itself given a float operand (as Dynamo lifts one on torch 2.15): the
    # inductor rule's loop gets tensors and ints only, and the step reads the float.
    from hops._inductor import inductor_rule

    def step(c, x, eps):
        return c * eps + x, c

    c, xs = torch.randn(3), torch.randn(4, 3)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda c, xs: hops.scan(step, c, xs, additional_inputs=(torch.ones(()),)))(c, xs)
    (node,) = [n for n in gm.graph.nodes if n.target is hops.scan_hop]
    body = getattr(gm, node.args[0].target)
    operands, spec = hops.scan_hop.split_args(node.args[1:])
    rule = inductor_rule(hops.scan_hop)

    def loop(c, xs):
        return rule(body, c, xs, 0.25, spec)

    traced = torch.fx.experimental.proxy_tensor.make_fx(loop)(c, xs)
    assert [n for n in traced.graph.nodes if n.target is torch.ops.higher_order.while_loop]
    got_carry, got_ys = loop(c, xs)
    expected, ys = c, []
    for x in xs:
        ys.append(expected)
        expected = expected * 0.25 + x
    torch.testing.assert_close(got_carry, expected)
    torch.testing.assert_close(got_ys, torch.stack(ys))
