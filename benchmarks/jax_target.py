"""Target ``"jax"``: per-step host time of ``backend="hops_jax"`` against the same model written in
JAX by hand and against eager torch; compile time of a scan of N layers against the unrolled
program, both lowered with ``lower_to_jax`` (4 virtual CPU devices).

1. Step: a two-layer MLP block with sharding annotations, loss and gradients per step, 8 layers,
   at two widths (batch 64 / dim 128, where dispatching is most of a step, and 256 / 512);
   ``hops_jax`` (Dynamo -> AOTAutograd -> lower_to_jax -> jax.jit, DLPack in and out), the same
   computation as ``jax.jit(jax.value_and_grad(...))`` with ``with_sharding_constraint``, the
   same by hand split as torch's autograd runs it (a forward program keeping ``jax.vjp``'s
   residuals, a backward program), and eager torch. Target (issue 35): hops_jax / hand-written
   JAX <= 1.1. All take host arrays each step (the torch tensors; numpy arrays for JAX), all
   return the loss to Python. hops_jax, the JAX steps and "torch alone" run round-robin (one step
   of each in turn) so a load change on a shared machine hits them alike; eager torch runs after
   them. "torch alone" is the same torch step compiled with graphs that compute nothing
   (``_ready_results``): torch's own work, which every torch.compile backend pays on top of its
   programs (Dynamo's guards, AOTAutograd's wrappers, the autograd engine). So
   (JAX by hand + torch alone) / JAX by hand is the least any backend running JAX's program can
   reach. Breakdown of a hops_jax step: the jitted programs (waited for), our conversions around
   them (``JaxGraph.__call__`` less the programs), and the rest, torch's.

   Measured (torch 2.13, jax 0.10.2, 2 cores, idle), ms per step, three runs:

   | width | hops_jax | JAX fused | JAX fused, grads to host | JAX split, to host | torch alone | eager |
   |---|---|---|---|---|---|---|
   | 64 / 128 | 4.52-4.62 | 3.12-3.55 | 3.37-3.53 | 4.91-5.32 | 0.86-0.88 | 2.75-3.27 |
   | 256 / 512 | 58.5 | 55.9 | 61.2 | 75.0 | 1.01 | 77.5 |

   From its second step, hops_jax runs the backward in the forward's program (``_Fused`` in
   ``passes/jax/backend.py``; before, split: 5.93 and 73.6 ms). At 256 / 512 the target is met
   (1.05x; 1.01-1.08x in earlier runs). At 64 / 128 it cannot be: torch alone, run between JAX
   programs, takes 0.86-0.88 ms, so the least any torch.compile backend can reach is 1.25-1.28x
   (run back to back on an idle machine, torch alone is 0.18 ms; between JAX programs, whose
   threads and memory traffic it then shares, 4-5x as long: 0.41-0.46 ms even 2 ms after a JAX step). hops_jax is at 1.30-1.45x, 0.05-0.17x above that floor: its per-call work (the
   tensors' views, the gradients back to torch).
2. Compile: ``make_fx`` of the loss and gradients of N blocks (``hops.scan`` over stacked weights,
   or a Python loop), ``lower_to_jax``, ``jax.jit(...).lower(...).compile()``, N = 4 and 64.
   Target: T(64) / T(4) <= 1.5 for the scan.

Usage: python benchmarks/jax_target.py   (prints ratios measured in this run; PASS/FAIL per target)
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import hops  # noqa: E402
from hops import Mesh, Replicate, Shard, ShardingSpec  # noqa: E402
from passes.jax import lower_to_jax  # noqa: E402
from passes.jax.backend import hops_jax  # noqa: E402

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
HIDDEN = ShardingSpec(MESH, (Shard(0), Shard(1)))
BATCH, DIM, LAYERS = 64, 128, 8
# A second width, where computing rather than dispatching is most of a step.
WIDE_BATCH, WIDE_DIM = 256, 512


def block(h, up, down):
    hidden = hops.annotate_sharding(torch.relu(h @ up), HIDDEN)
    return hops.annotate_sharding(h + hidden @ down, ROWS)


def torch_loss(h, ups, downs):
    for up, down in zip(ups, downs):
        h = block(h, up, down)
    return h.square().mean()


def jax_loss(h, ups, downs):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    hidden_layout = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    for up, down in zip(ups, downs):
        hidden = jax.lax.with_sharding_constraint(jax.nn.relu(h @ up), hidden_layout)
        h = jax.lax.with_sharding_constraint(h + hidden @ down, rows)
    return jnp.mean(h * h)


def per_step(steps: dict, repeats=30) -> dict[str, float]:
    """Median ms per step of each of ``steps`` (name -> step), run round-robin."""
    for _ in range(3):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def breakdown(step, graphs, repeats=30) -> dict[str, float]:
    """Median ms per hops_jax step: the jitted programs, our conversions around them, torch's rest."""
    from passes.jax.backend import JaxGraph

    spent = {"programs": 0.0, "graph calls": 0.0}
    call = JaxGraph.__call__
    # (a forward's program with its backward fused in, once the backward has run: ``_Fused``)
    graphs = [*graphs, *(g.fused for g in graphs if g.fused is not None)]
    functions = [g.function for g in graphs]

    def timed_program(function):
        def run(*args):
            start = time.perf_counter()
            out = jax.block_until_ready(function(*args))
            spent["programs"] += time.perf_counter() - start
            return out

        return run

    def timed_call(self, *args):
        start = time.perf_counter()
        out = call(self, *args)
        spent["graph calls"] += time.perf_counter() - start
        return out

    for graph in graphs:
        graph.function = timed_program(graph.function)
    JaxGraph.__call__ = timed_call
    rows = []
    try:
        for _ in range(repeats):
            spent.update(programs=0.0, **{"graph calls": 0.0})
            start = time.perf_counter()
            step()
            total = time.perf_counter() - start
            rows.append((total, spent["programs"], spent["graph calls"]))
    finally:
        JaxGraph.__call__ = call
        for graph, function in zip(graphs, functions):
            graph.function = function
    total, programs, calls = (statistics.median(column) * 1e3 for column in zip(*rows))
    return {"step": total, "jitted programs": programs, "ours (conversions)": calls - programs, "torch (Dynamo, AOTAutograd, autograd)": total - calls}


def _ready_results(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """An AOTAutograd compiler whose graph returns new uninitialized tensors of its outputs' shapes
    and runs nothing: a step compiled with it costs only torch's own work (``torch_alone``)."""
    from functorch.compile import make_boxed_func

    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    shapes = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) if isinstance(n, torch.fx.Node) else None for n in outputs]
    return make_boxed_func(lambda *args: [None if s is None else torch.empty(s[0], dtype=s[1]) for s in shapes])


def step_times(batch: int = BATCH, dim: int = DIM) -> tuple[dict[str, float], dict[str, float]]:
    from passes.jax import backend

    torch._dynamo.reset()  # each width compiled with static shapes, as in a process of its own
    torch.manual_seed(0)
    h = torch.randn(batch, dim)
    ups = [(torch.randn(dim, 2 * dim) / dim**0.5).requires_grad_() for _ in range(LAYERS)]
    downs = [(torch.randn(2 * dim, dim) / (2 * dim) ** 0.5).requires_grad_() for _ in range(LAYERS)]
    params = [*ups, *downs]

    def torch_step(loss_fn):
        def step():
            loss = loss_fn(h, ups, downs)
            grads = torch.autograd.grad(loss, params)
            return loss.item(), grads

        return step

    compiled = torch.compile(torch_loss, backend=hops_jax, fullgraph=True)
    by_hand = jax.jit(jax.value_and_grad(jax_loss, argnums=(1, 2)))
    h_np, ups_np, downs_np = h.numpy(), [u.detach().numpy() for u in ups], [d.detach().numpy() for d in downs]

    def jax_step():
        loss, grads = by_hand(h_np, ups_np, downs_np)
        jax.block_until_ready(grads)
        return float(loss)

    def jax_step_to_host():  # the gradients gathered into host arrays, as a torch user gets them
        loss, grads = by_hand(h_np, ups_np, downs_np)
        return float(loss), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]

    # The same by hand as torch's autograd runs it: a forward program that keeps its residuals
    # (``jax.vjp``'s function is a pytree of them) and a backward program given the loss's
    # cotangent; the gradients gathered to host. The floor of any torch backend ending in JAX.
    forward = jax.jit(lambda h, ups, downs: jax.vjp(lambda ups, downs: jax_loss(h, ups, downs), ups, downs))
    backward = jax.jit(lambda vjp, cotangent: vjp(cotangent))

    def jax_step_split():
        loss, vjp = forward(h_np, ups_np, downs_np)
        grads = backward(vjp, np.ones((), np.float32))
        return float(loss), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]

    hops_step = torch_step(compiled)
    hops_step()
    graphs = backend.COMPILED[-2:]  # its forward and backward
    # torch's own work in a step, with graphs that compute nothing: Dynamo's guards, AOTAutograd's
    # wrappers, the autograd engine. Every torch.compile backend pays it on top of its programs;
    # timed in the same round-robin, as it runs between JAX programs (idle and alone it is less than
    # half as long: a JAX program leaves torch's code and data out of the caches).
    torch_alone = torch_step(torch.compile(torch_loss, backend=aot_autograd(fw_compiler=_ready_results, bw_compiler=_ready_results), fullgraph=True))
    times = per_step(
        {
            "hops_jax": hops_step,
            "jax by hand": jax_step,
            "jax, grads to host": jax_step_to_host,
            "jax, split, to host": jax_step_split,
            "torch alone": torch_alone,
        }
    )
    # eager torch on its own: its intra-op threads stay busy after a step and would slow the next
    times.update(per_step({"eager torch": torch_step(torch_loss)}))
    return times, breakdown(hops_step, graphs)


def compile_time(layers: int, scanned: bool) -> float:
    h = torch.randn(BATCH, DIM)
    ups = torch.randn(layers, DIM, 2 * DIM) / DIM**0.5
    downs = torch.randn(layers, 2 * DIM, DIM) / (2 * DIM) ** 0.5

    def loss(h, ups, downs):
        if scanned:
            h, _ = hops.scan(lambda c, w: (block(c, w[0], w[1]), None), h, (ups, downs))
        else:
            for up, down in zip(ups, downs):
                h = block(h, up, down)
        return h.square().mean()

    def loss_and_grads(h, ups, downs):
        value = loss(h, ups, downs)
        return value, torch.autograd.grad(value, (ups, downs))

    start = time.perf_counter()
    graph = make_fx(loss_and_grads, tracing_mode="fake")(h, ups.requires_grad_(), downs.requires_grad_())
    jax.jit(lower_to_jax(graph)).lower(h.numpy(), ups.detach().numpy(), downs.detach().numpy()).compile()
    return time.perf_counter() - start


def main() -> None:
    for batch, dim in ((BATCH, DIM), (WIDE_BATCH, WIDE_DIM)):
        times, parts = step_times(batch, dim)
        print(f"per step (ms, median; {LAYERS} layers, batch {batch}, dim {dim}, 4 CPU devices):")
        for name, ms in times.items():
            print(f"  {name:20s} {ms:8.2f}")
        ratio = times["hops_jax"] / times["jax by hand"]
        print(f"  hops_jax / jax by hand = {ratio:.2f}  target <= 1.1: {'PASS' if ratio <= 1.1 else 'FAIL'}")
        print(f"  hops_jax / jax with the gradients gathered to host = {times['hops_jax'] / times['jax, grads to host']:.2f}")
        print(f"  hops_jax / jax split into forward and backward, to host = {times['hops_jax'] / times['jax, split, to host']:.2f}")
        print(f"  hops_jax / eager torch = {times['hops_jax'] / times['eager torch']:.2f}")
        floor = (times["jax by hand"] + times["torch alone"]) / times["jax by hand"]
        print(f"  (jax by hand + torch alone) / jax by hand = {floor:.2f}: no torch.compile backend running JAX's program is under it")
        print("hops_jax step, broken down (ms, median of an instrumented run; programs waited for):")
        for name, ms in parts.items():
            print(f"  {name:38s} {ms:8.2f}")
    print("compile (s: make_fx + lower_to_jax + jit compile, loss and gradients):")
    results = {}
    for scanned in (True, False):
        for layers in (4, 64):
            results[scanned, layers] = compile_time(layers, scanned)
            print(f"  {'scan    ' if scanned else 'unrolled'} N={layers:3d}: {results[scanned, layers]:7.2f}")
    growth = results[True, 64] / results[True, 4]
    print(f"  scan T(64)/T(4) = {growth:.2f}  target <= 1.5: {'PASS' if growth <= 1.5 else 'FAIL'}")
    print(f"  unrolled T(64)/T(4) = {results[False, 64] / results[False, 4]:.2f}; unrolled/scan at 64 = {results[False, 64] / results[True, 64]:.2f}")


if __name__ == "__main__":
    main()
