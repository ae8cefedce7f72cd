"""Scenarios for ``passes.lower_to_dtensor`` run by real processes (``tests/test_dtensor.py``).

Each rank runs every scenario once and writes ``rank<r>.json`` to the output directory:
per scenario ``error`` (a traceback, or None), ``comms`` (collective counts by kind, from
``CommDebugMode``) and what the scenario reports (placements, predicted counts). Each
scenario compares every value it computes on DTensors (``full_tensor()``) with single-device
eager on every rank. Run by the test's spawner (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set), or ``torchrun --nproc-per-node 4 tests/helpers/dtensor_scenarios.py OUTDIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.fx.experimental.proxy_tensor import make_fx

# Run as a script, this file finds the repository (for ``tests.helpers``) and its examples.
_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_root, os.path.join(_root, "examples")]

import run_on_dtensor  # noqa: E402

import hops  # noqa: E402
import passes  # noqa: E402
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec, _compat  # noqa: E402
from passes.dtensor import collective_counts  # noqa: E402
from passes.dtensor.runtime import run_replicated  # noqa: E402
from tests.helpers.snapshot import aot_trace  # noqa: E402

MESH = Mesh.of(data=2, model=2)
ROWS, WHOLE = (Shard(0), Replicate()), (Replicate(), Replicate())
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def on_mesh(device_mesh, tensor, placements):
    return distribute_tensor(tensor, device_mesh, [p.to_dtensor() for p in placements])


def names(placements):
    return [repr(Placement) for Placement in placements]


def eager_grads(fn, *args):
    leaves = [a.clone().requires_grad_() for a in args]
    out = fn(*leaves)
    out.sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def run_aot(device_mesh, fn, reference, args, placements, report):
    """Trace ``fn`` with AOTAutograd, lower both graphs, run them on DTensors laid out per
    ``placements``; compare the output and the gradients of its sum with ``reference``."""
    forward, backward, _ = aot_trace(fn, *(a.clone().requires_grad_() for a in args))
    passes.lower_to_dtensor(forward, device_mesh)
    passes.lower_to_dtensor(backward, device_mesh)
    expected, expected_grads = eager_grads(reference, *args)
    # Laid out before counting: distribute_tensor's own scatter / broadcast are not the graph's.
    inputs = [on_mesh(device_mesh, a, p) for a, p in zip(args, placements)]
    with CommDebugMode() as forward_comms, torch.no_grad():
        out, *saved = forward(*inputs)
    # A whole cotangent (not laid out like the output, which may be a pending sum).
    cotangent = on_mesh(device_mesh, torch.ones(out.shape), WHOLE)
    with CommDebugMode() as backward_comms, torch.no_grad():
        grads = backward(*saved, cotangent)
    torch.testing.assert_close(out.full_tensor(), expected)
    for i, (grad, want) in enumerate(zip(grads, expected_grads)):
        torch.testing.assert_close(grad.full_tensor(), want, msg=f"gradient {i}")
    report["forward_comms"] = collective_counts(forward_comms)
    report["backward_comms"] = collective_counts(backward_comms)
    report["grad_placements"] = [names(g.placements) for g in grads]
    return forward, backward


# --------------------------------------------------------------------------- annotations


def annotation_program(placements, grad_placements=None):
    spec = ShardingSpec(MESH, placements, grad_placements)
    return make_fx(lambda x: hops.annotate_sharding(x, spec), tracing_mode="fake")(torch.randn(4, 4))


def run_annotation(device_mesh, report, placements, value):
    """The lowered annotation to ``placements`` applied to the DTensor ``value``; its
    collectives and output placements reported."""
    gm = passes.lower_to_dtensor(annotation_program(placements), device_mesh)
    with CommDebugMode() as comms:
        out = gm(value)
    report["comms"] = collective_counts(comms)
    report["placements"] = names(out.placements)
    return out


@scenario
def annotation_keeping_the_layout(device_mesh, report):
    x = torch.randn(4, 4)
    out = run_annotation(device_mesh, report, ROWS, on_mesh(device_mesh, x, ROWS))
    torch.testing.assert_close(out.full_tensor(), x)


@scenario
def annotation_shard_to_replicate(device_mesh, report):
    x = torch.randn(4, 4)
    out = run_annotation(device_mesh, report, WHOLE, on_mesh(device_mesh, x, ROWS))
    torch.testing.assert_close(out.to_local(), x)


@scenario
def annotation_of_a_partial_value(device_mesh, report):
    x = torch.randn(4, 4)
    # Each rank holds a quarter: the value is their sum (Partial on both axes).
    partial = DTensor.from_local(x / 4, device_mesh, [Partial().to_dtensor()] * 2, run_check=False)
    out = run_annotation(device_mesh, report, ROWS, partial)
    torch.testing.assert_close(out.full_tensor(), x)


@scenario
def annotation_gradient_layout_under_autograd(device_mesh, report):
    # A forward-only lowered graph run under autograd: the gradient takes the grad layout.
    gm = passes.lower_to_dtensor(annotation_program(ROWS, WHOLE), device_mesh)
    x = on_mesh(device_mesh, torch.randn(4, 4), (Shard(1), Replicate())).requires_grad_()
    grad = torch.randn(4, 4)
    out = gm(x)
    cotangent = on_mesh(device_mesh, grad, ROWS)
    with CommDebugMode() as comms:
        out.backward(cotangent)
    report["comms"] = collective_counts(comms)
    report["placements"] = names(out.placements)
    report["grad_placements"] = names(x.grad.placements)
    torch.testing.assert_close(x.grad.full_tensor(), grad)


@scenario
def annotation_in_aot_backward_graph(device_mesh, report):
    spec = ShardingSpec(MESH, ROWS, (Shard(1), Replicate()))

    def fn(x):
        return hops.annotate_sharding(x * 2, spec).tanh()

    forward, backward = run_aot(device_mesh, fn, lambda x: (x * 2).tanh(), (torch.randn(4, 4),), (WHOLE,), report)
    report["backward_specs"] = [
        repr(n.args[-1]) for n in backward.graph.nodes if n.op == "call_function" and "annotate" in str(n.target)
    ]


# --------------------------------------------------------------------------- local_map


def matmul(x, w):
    return x @ w


@scenario
def region_replicated_weight_gets_a_partial_gradient(device_mesh, report):
    # autoparallel#515: the weight is whole on every rank, each rank's gradient a partial sum.
    region = hops.local_map(
        matmul, mesh=MESH, in_placements=(ROWS, WHOLE), out_placements=ROWS, in_grad_placements=(ROWS, (Partial(), Replicate()))
    )
    args = (torch.randn(8, 6), torch.randn(6, 4))
    run_aot(device_mesh, region, matmul, args, (ROWS, WHOLE), report)
    # The same graph forward-only, under autograd.
    gm = passes.lower_to_dtensor(make_fx(region, tracing_mode="fake")(*args), device_mesh)
    x, w = on_mesh(device_mesh, args[0], ROWS).requires_grad_(), on_mesh(device_mesh, args[1], WHOLE).requires_grad_()
    with CommDebugMode() as comms:
        gm(x, w).sum().backward()
    _, (x_grad, w_grad) = eager_grads(matmul, *args)
    torch.testing.assert_close(w.grad.full_tensor(), w_grad)
    torch.testing.assert_close(x.grad.full_tensor(), x_grad)
    report["autograd_comms"] = collective_counts(comms)
    report["autograd_grad_placements"] = [names(x.grad.placements), names(w.grad.placements)]


def scaled_sum(x):
    return (x * 3).sum(0)


@scenario
def region_replicated_output_pending_sum_cotangent(device_mesh, report):
    # Default convention: a replicated output's cotangent is a pending sum, so a replicated
    # input's gradient is Partial and sums to the right value.
    region = hops.local_map(scaled_sum, mesh=MESH, in_placements=(WHOLE,), out_placements=WHOLE)
    run_aot(device_mesh, region, scaled_sum, (torch.randn(4, 4),), (WHOLE,), report)


@scenario
def region_replicated_output_whole_cotangent(device_mesh, report):
    # torch's convention (in_grad_placements given): every rank receives the whole cotangent.
    region = hops.local_map(scaled_sum, mesh=MESH, in_placements=(WHOLE,), out_placements=WHOLE, in_grad_placements=(WHOLE,))
    run_aot(device_mesh, region, scaled_sum, (torch.randn(4, 4),), (WHOLE,), report)


@hops.kernel(abstract=lambda x: torch.empty_like(x), backward=lambda x, out, grad: (grad * (1 - out * out),))
def tanh_kernel(x):
    return torch.tanh(x)


def kernel_body(x, w):
    return tanh_kernel(x @ w)


@scenario
def kernel_in_a_region(device_mesh, report):
    region = hops.local_map(kernel_body, mesh=MESH, in_placements=(ROWS, WHOLE), out_placements=ROWS)
    run_aot(device_mesh, region, lambda x, w: torch.tanh(x @ w), (torch.randn(8, 6), torch.randn(6, 4)), (ROWS, WHOLE), report)


def tanh_project(x, w):
    return torch.tanh(x @ w)


@scenario
def region_alternatives_with_other_local_shapes(device_mesh, report):
    """Row-parallel (x's rows over "model") or column-parallel (w's columns over "model"): the
    graphs carry both bodies; each alternative, chosen in forward and backward, runs its own."""
    along_model, columns = (Replicate(), Shard(0)), (Replicate(), Shard(1))
    region = hops.local_map(
        tanh_project, mesh=MESH, in_placements=(along_model, WHOLE), out_placements=along_model,
        alternatives=[hops.RegionPlacements((WHOLE, columns), (columns,))],
    )
    args = (torch.randn(8, 6), torch.randn(6, 4))
    for index, placements in enumerate([(along_model, WHOLE), (WHOLE, columns)]):
        forward, backward, _ = aot_trace(region, *(a.clone().requires_grad_() for a in args))
        for gm in (forward, backward):
            for node in gm.graph.nodes:
                if node.target is hops.local_map_hop:
                    node.args = (*node.args[:-1], node.args[-1].choose(index))
            gm.recompile()
        passes.lower_to_dtensor(forward, device_mesh)
        passes.lower_to_dtensor(backward, device_mesh)
        expected, expected_grads = eager_grads(tanh_project, *args)
        out, *saved = forward(*(on_mesh(device_mesh, a, p) for a, p in zip(args, placements)))
        grads = backward(*saved, on_mesh(device_mesh, torch.ones(out.shape), WHOLE))
        torch.testing.assert_close(out.full_tensor(), expected)
        for i, (grad, want) in enumerate(zip(grads, expected_grads)):
            torch.testing.assert_close(grad.full_tensor(), want, msg=f"alternative {index}: gradient {i}")
        report[f"alternative {index}"] = dict(out=names(out.placements), grads=[names(g.placements) for g in grads])


# --------------------------------------------------------------------------- scan, scopes


def rnn_step(h, x, w):
    h = hops.annotate_sharding(torch.tanh(h @ w + x), ShardingSpec(MESH, ROWS))
    return h, h.sum(-1)


def rnn(h, xs, w):
    h, ys = hops.scan(rnn_step, h, xs, additional_inputs=(w,))
    return h.sum() + ys.square().sum()


def rnn_reference(h, xs, w):
    ys = []
    for x in xs:
        h = torch.tanh(h @ w + x)
        ys.append(h.sum(-1))
    return h.sum() + torch.stack(ys).square().sum()


@scenario
def scan_with_an_annotated_body(device_mesh, report):
    args = (torch.randn(4, 3), torch.randn(5, 4, 3), torch.randn(3, 3) / 2)
    run_aot(device_mesh, rnn, rnn_reference, args, (ROWS, WHOLE, WHOLE), report)


@hops.named_scope("block")
def scoped_block(x, w):
    return torch.tanh(x @ w)


@scenario
def named_scope_inlined_and_recorded(device_mesh, report):
    args = (torch.randn(4, 6), torch.randn(6, 6))
    forward, _ = run_aot(device_mesh, scoped_block, lambda x, w: torch.tanh(x @ w), args, (ROWS, WHOLE), report)
    report["inlined_code_mentions_scope"] = "profiler_scope" in forward.code
    recorded = passes.lower_to_dtensor(make_fx(scoped_block, tracing_mode="fake")(*args), device_mesh, record_scopes=True)
    with torch.profiler.profile() as profile:
        out = recorded(*(on_mesh(device_mesh, a, p) for a, p in zip(args, (ROWS, WHOLE))))
    torch.testing.assert_close(out.full_tensor(), torch.tanh(args[0] @ args[1]))
    report["recorded_events"] = sorted({e.name for e in profile.events() if e.name == "block"})


# --------------------------------------------------------------------------- ops without a DTensor rule


@torch.library.custom_op("hops_dtensor_scenarios::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    """An op DTensor has no sharding strategy for (any op of a library but DTensor's)."""
    return x * x * x


cube.register_fake(lambda x: torch.empty_like(x))
cube.register_autograd(
    lambda ctx, grad: grad * 3 * ctx.x * ctx.x, setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
)


@scenario
def op_without_a_rule_under_autograd(device_mesh, report):
    # A forward graph run under autograd: the op's inputs gathered, its gradient sent back
    # through the gather (Replicate -> Shard(0): each rank keeps its rows, no collective).
    def fn(x):
        return cube(x * 2) + 1

    x = torch.randn(4, 4)
    gm = passes.lower_to_dtensor(make_fx(fn, tracing_mode="fake")(x), device_mesh)
    distributed = on_mesh(device_mesh, x, ROWS).requires_grad_()
    with CommDebugMode() as comms:
        out = gm(distributed)
        out.sum().backward()
    expected, (grad,) = eager_grads(fn, x)
    torch.testing.assert_close(out.full_tensor(), expected)
    torch.testing.assert_close(distributed.grad.full_tensor(), grad)
    report["comms"] = collective_counts(comms)
    report["placements"] = names(out.placements)
    report["grad_placements"] = names(distributed.grad.placements)


@scenario
def checks_without_a_rule(device_mesh, report):
    # torch.export's metadata check and an asserted value, both without a DTensor strategy, on a
    # DTensor sharded by rows: what the program states of the global value holds (the metadata
    # checked without a collective, the value gathered), and a false statement still raises.
    def program(size, bound):
        def fn(x):
            torch.ops.aten._assert_tensor_metadata.default(x, size, None, dtype=torch.float32, layout=torch.strided)
            torch.ops.aten._assert_async.msg((x.abs().amax() < bound).all(), "x is bounded")
            return x * 2

        return passes.lower_to_dtensor(make_fx(fn)(torch.zeros(8, 4)), device_mesh)

    x = torch.randn(8, 4)
    distributed = on_mesh(device_mesh, x, ROWS)
    with CommDebugMode() as comms:
        out = program([8, 4], 1e6)(distributed)
    torch.testing.assert_close(out.full_tensor(), x * 2)
    report["comms"] = collective_counts(comms)
    for size, bound, message in [([4, 4], 1e6, "sizes mismatch"), ([8, 4], 1e-6, "x is bounded")]:
        try:
            program(size, bound)(distributed)
        except RuntimeError as error:
            assert message in str(error), error
        else:
            raise AssertionError(f"the check {size}, {bound} did not raise")


@scenario
def ops_dtensor_runs_only_by_the_lowering(device_mesh, report):
    # Ops DTensor 2.9 cannot run as they are: fill.Scalar (placed by fill_'s rule), two
    # embedding backwards (autograd's, at run time) that differ only in the vocabulary's size
    # (its cache gave the second the first's global shape), and a LayerNorm backward in the
    # graph whose weight and bias are sharded. Loss and gradients against eager, rows sharded.
    def fn(ids, x, big, small):
        ones = torch.ops.aten.fill.Scalar(x, 1.0)
        return (torch.nn.functional.embedding(ids, big) + torch.nn.functional.embedding(ids, small)).sum() * (ones * x).sum()

    ids = torch.randint(0, 6, (8, 3))
    args = (torch.randn(8, 4), torch.randn(12, 4), torch.randn(6, 4))
    leaves = [a.clone().requires_grad_() for a in args]
    expected = fn(ids, *leaves)
    expected.backward()
    gm = passes.lower_to_dtensor(make_fx(fn)(ids, *args), device_mesh)
    distributed = [on_mesh(device_mesh, a, p).requires_grad_() for a, p in zip(args, (ROWS, WHOLE, WHOLE))]
    out = gm(on_mesh(device_mesh, ids, ROWS), *distributed)
    out.backward()
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    for i, (d, leaf) in enumerate(zip(distributed, leaves)):
        torch.testing.assert_close(d.grad.full_tensor(), leaf.grad, msg=lambda m: f"gradient {i}: {m}")

    # A traced training step's LayerNorm backward with the weight and bias sharded (as a
    # solver's plan may keep them): DTensor 2.9 handed its kernel their shards.
    def step(x, w, b):
        loss = torch.nn.functional.layer_norm(x, (4,), w, b).square().sum()
        return (loss, *torch.autograd.grad(loss, (x, w, b)))

    x, w, b = torch.randn(8, 4), torch.randn(4), torch.randn(4)
    expected = step(*(t.clone().requires_grad_() for t in (x, w, b)))
    gm = passes.lower_to_dtensor(make_fx(step)(*(t.clone().requires_grad_() for t in (x, w, b))), device_mesh)
    got = gm(*(on_mesh(device_mesh, t, ROWS) for t in (x, w, b)))
    for name, value, reference in zip(("loss", "grad x", "grad w", "grad b"), got, expected):
        torch.testing.assert_close(value.full_tensor(), reference.detach(), msg=lambda m: f"layer_norm {name}: {m}")


@scenario
def constants_and_factory_ops(device_mesh, report):
    # A tensor constant (get_attr) and factory ops' results (arange, full) next to DTensors:
    # every rank makes them whole, the lowering takes them as replicated DTensors.
    def fn(x):
        return (x * torch.tensor([1.0, -2.0, 3.0, 0.5]) + torch.arange(4.0)) * torch.full((4, 4), 2.0)

    x = torch.randn(4, 4)
    gm = passes.lower_to_dtensor(make_fx(fn)(x), device_mesh)
    out = gm(on_mesh(device_mesh, x, ROWS))
    torch.testing.assert_close(out.full_tensor(), fn(x))
    report["placements"] = names(out.placements)


# --------------------------------------------------------------------------- plans: examples, the solver
#
# What a rank runs of an example is a plan (``run_on_dtensor``): graphs traced (and solved)
# without a process group. Under the test, its process makes each plan once and writes it to
# ``$HOPS_DTENSOR_PLANS/<name>.pkl`` while the ranks run the scenarios above; a rank waits for
# the file. Run by hand (no ``HOPS_DTENSOR_PLANS``), each rank makes the plans itself.

PLANS_ENV = "HOPS_DTENSOR_PLANS"
PLAN_WAIT_SECONDS = 200
# The decoder of examples/auto_shard.py, small: two layers (a scan of two steps), one region.
AUTO_SHARD_CONFIG = dict(dim=16, heads=2, kv_heads=1, vocab=32, ffn=32, layers=2, batch=2, seq=4)


def plan_solved_mlp() -> dict:
    """A two-layer MLP without annotations, placed by ``passes.solve_placements`` on the 2x2 mesh
    for a device whose compute is slow next to its free links, so the plan shards and
    redistributes; ``predicted``: the collectives the solution says each graph issues on CPU."""
    torch.manual_seed(0)
    args = [torch.randn(16, 32), torch.randn(32, 64) / 32**0.5, torch.randn(64, 32) / 64**0.5]

    def loss(x, w1, w2):
        return (torch.tanh(x @ w1) @ w2).square().mean()

    forward, backward, _ = aot_trace(loss, *(a.clone().requires_grad_() for a in args))
    cost_model = passes.CostModel(peak_flops=1e9, memory_bandwidth=1e12, link_bandwidth=1e12, link_latency=0.0)
    solution = passes.solve_placements((forward, backward), MESH, cost_model=cost_model)
    passes.apply_placements((forward, backward), solution, pending_sums=True)
    reference, grads = run_on_dtensor._reference(loss, args, range(3))
    placeholders = [node.name for node in forward.graph.find_nodes(op="placeholder")]
    return dict(
        mesh=MESH, forward=forward, backward=backward, inputs=args,
        placements=[solution.placements[f"forward/{name}"] for name in placeholders],
        loss=reference, grads=grads, tolerance={},
        predicted={graph: solution.collectives(graph, device_type="cpu") for graph in ("forward", "backward")},
    )


def causal_attention(x, wq, wk, wv, wo):
    """One attention layer as torchtitan writes it: SDPA (on CPU, flash attention for CPU, for
    which DTensor has no sharding strategy, forward or backward), causal, two heads."""
    batch, seq, dim = x.shape

    def heads(t):
        return t.view(batch, seq, 2, dim // 2).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(heads(x @ wq), heads(x @ wk), heads(x @ wv), is_causal=True)
    return (out.transpose(1, 2).reshape(batch, seq, dim) @ wo).square().mean()


def plan_attention(solved: bool) -> dict:
    """``causal_attention``'s graphs, placed by the solver (for slow compute and free links, so
    it shards around the attention op it prices replicated) or with every input replicated."""
    torch.manual_seed(0)
    args = [torch.randn(2, 8, 16)] + [torch.randn(16, 16) / 4 for _ in range(4)]
    forward, backward, _ = aot_trace(causal_attention, *(a.clone().requires_grad_() for a in args))
    reference, grads = run_on_dtensor._reference(causal_attention, args, range(len(args)))
    plan = dict(mesh=MESH, forward=forward, backward=backward, inputs=args, placements=[WHOLE] * len(args),
                loss=reference, grads=grads, tolerance=dict(rtol=1e-4, atol=1e-5))
    if solved:
        cost_model = passes.CostModel(peak_flops=1e9, memory_bandwidth=1e12, link_bandwidth=1e12, link_latency=0.0)
        solution = passes.solve_placements((forward, backward), MESH, cost_model=cost_model)
        passes.apply_placements((forward, backward), solution, pending_sums=True)
        placeholders = [node.name for node in forward.graph.find_nodes(op="placeholder")]
        plan.update(
            placements=[solution.placements[f"forward/{name}"] for name in placeholders],
            predicted={graph: solution.collectives(graph, device_type="cpu") for graph in ("forward", "backward")},
            unsupported_ops=solution.stats["unsupported_ops"],
        )
    return plan


def attention_viewing_heads_back(x, wq, wk, wv, wo):
    """``causal_attention`` as torchtitan ends it: ``.contiguous().flatten(2)``, which the trace
    records as a ``view`` (SDPA's CPU output and its gradients are laid out so that no copy is
    needed)."""
    batch, seq, dim = x.shape

    def heads(t):
        return t.view(batch, seq, 2, dim // 2).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(heads(x @ wq), heads(x @ wk), heads(x @ wv), is_causal=True)
    return (out.transpose(1, 2).contiguous().flatten(2) @ wo).square().mean()


def plan_attention_with_sharded_heads() -> dict:
    """``attention_viewing_heads_back`` with its heads sharded (column-parallel projections):
    the gathered inputs of the op DTensor has no rule for are laid out otherwise than traced,
    and CPU flash attention's gradients follow its inputs' layout."""
    torch.manual_seed(0)
    args = [torch.randn(2, 8, 16)] + [torch.randn(16, 16) / 4 for _ in range(4)]
    forward, backward, _ = aot_trace(attention_viewing_heads_back, *(a.clone().requires_grad_() for a in args))
    reference, grads = run_on_dtensor._reference(attention_viewing_heads_back, args, range(len(args)))
    columns = (Replicate(), Shard(1))
    return dict(mesh=MESH, forward=forward, backward=backward, inputs=args,
                placements=[ROWS, columns, columns, columns, (Replicate(), Shard(0))],
                loss=reference, grads=grads, tolerance=dict(rtol=1e-4, atol=1e-5))


def plan_auto_shard() -> dict:
    import auto_shard

    return run_on_dtensor.plan_auto_shard(auto_shard.Config(**AUTO_SHARD_CONFIG))


# In the order the ranks run them (the test's process makes them in this order).
PLANS = {
    "sharded_mlp": run_on_dtensor.plan_sharded_mlp,
    "local_map_attention": run_on_dtensor.plan_local_map_attention,
    "scan_layers": run_on_dtensor.plan_scan_layers,
    "solved_mlp": plan_solved_mlp,
    "replicated_attention": lambda: plan_attention(solved=False),
    "solved_attention": lambda: plan_attention(solved=True),
    "attention_with_sharded_heads": plan_attention_with_sharded_heads,
    "auto_shard": plan_auto_shard,
}

# Scenarios DTensor of this torch cannot run, with why (the test skips them saying so).
UNSUPPORTED = {}
if not _compat.DTENSOR_FLATTENS_SHARDED_DIMS:
    UNSUPPORTED["example_local_map_attention"] = (
        "DTensor before torch 2.13 cannot view [4, 8, 16] laid out (Shard(0), Shard(1)) as [32, 16] "
        "(flattening dims sharded on different mesh axes needs _StridedShard)"
    )


def plan_path(outdir: str, name: str) -> str:
    return os.path.join(outdir, f"{name}.pkl")


def write_plans(outdir: str) -> None:
    """Make every plan and write it (or the error making it) where ``load_plan`` waits for it."""
    import pickle

    for name, make_plan in PLANS.items():
        if f"example_{name}" in UNSUPPORTED:
            continue
        try:
            payload = pickle.dumps({"plan": make_plan()})
        except Exception:  # the rank running this plan reports it
            payload = pickle.dumps({"error": traceback.format_exc()})
        path = plan_path(outdir, name)
        with open(path + ".tmp", "wb") as f:
            f.write(payload)
        os.replace(path + ".tmp", path)  # a rank never reads half a file


def load_plan(name: str) -> dict:
    import pickle

    outdir = os.environ.get(PLANS_ENV)
    if not outdir:
        return PLANS[name]()
    path = plan_path(outdir, name)
    deadline = time.monotonic() + PLAN_WAIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan {path} after {PLAN_WAIT_SECONDS} s")
        time.sleep(0.05)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    if "error" in loaded:
        raise RuntimeError(f"making plan {name!r} in the test's process failed:\n{loaded['error']}")
    return loaded["plan"]


def run_example(name: str, report: dict) -> None:
    plan = load_plan(name)
    report.update(run_on_dtensor.run_plan(plan))
    for key in ("predicted", "unsupported_ops"):
        if key in plan:
            report[key] = plan[key]
    # The ops the lowering runs replicated, by graph (every other op DTensor places itself).
    report["run_replicated"] = {
        graph: sorted(str(n.args[0]) for n in plan[graph].graph.nodes if n.target is run_replicated)
        for graph in ("forward", "backward")
    }


@scenario
def example_sharded_mlp(device_mesh, report):
    run_example("sharded_mlp", report)


@scenario
def example_local_map_attention(device_mesh, report):
    run_example("local_map_attention", report)


@scenario
def example_scan_layers(device_mesh, report):
    run_example("scan_layers", report)


@scenario
def solved_mlp(device_mesh, report):
    run_example("solved_mlp", report)


@scenario
def replicated_attention(device_mesh, report):
    run_example("replicated_attention", report)


@scenario
def solved_attention(device_mesh, report):
    run_example("solved_attention", report)


@scenario
def attention_with_sharded_heads(device_mesh, report):
    run_example("attention_with_sharded_heads", report)


@scenario
def example_auto_shard(device_mesh, report):
    run_example("auto_shard", report)


def main(outdir: str, only: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device_mesh = MESH.to_device_mesh()
    run_on_dtensor._DEVICE_MESHES[MESH] = device_mesh
    results = {}
    for name, fn in SCENARIOS.items():
        if (only and name not in only) or name in UNSUPPORTED:
            continue
        report = {"error": None}
        start = time.perf_counter()
        try:
            torch.manual_seed(0)
            fn(device_mesh, report)
        except Exception:  # recorded per scenario: the test of that scenario fails with it
            report["error"] = traceback.format_exc()
        report["seconds"] = round(time.perf_counter() - start, 2)
        results[name] = report
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    # This process is a CPU program: nothing may have brought up torch_xla (and its PJRT client).
    results["process"] = {"error": None, "torch_xla_imported": "torch_xla" in sys.modules}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
