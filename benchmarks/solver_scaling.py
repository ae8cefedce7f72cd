"""How the solver scales with the number of layers, against the unrolled program.

The model is ``examples/auto_shard.py``'s LLaMA-style decoder at the dims of
meta-pytorch/autoparallel's LLaMA-3 test model (dim 256, 16 heads, 4 kv heads, vocab 2048,
seq 512, batch 16, SwiGLU hidden 768), placed on an 8x8 fake mesh with the ``h100`` cost model,
N = 1, 2, 4, 8, 16, 32 layers, two ways:

  scan      the layers as one ``hops.scan`` over stacked weights (the example's program);
  unrolled  a Python loop over the layers (the same layer function, one weight slice per layer).

End to end = AOTAutograd trace of the training step (on fake tensors) + placement graph
(DTensor strategies) + ILP build (with the exact reductions) + solve. Printed per N: variables,
each phase's seconds, the optimum. Then, from the same run:

- bars: scan variables at N=32 == N=1; T(32)/T(1) <= 1.2 (scan, end to end; N=1 and N=32 run
  three more times alternately, medians compared: the machine is shared); N=32 scan end to end
  <= 15 s (median); quality at N=2 and 4: the scan plan's cost measured on the scan program unrolled per
  step (``passes.solver.unrolled``: the same values, strategies and cost model, each step free
  to take its own placements) within 1% of that unrolled problem's optimum;
- plan quality against the Python loop, at N = 1, 2, 4, 8: the scan plan (its body solved once)
  costs <= 1.02x the unrolled program's optimum. Measured apples to apples: the scan plan's cost
  is ``evaluate_placements`` of it on the scan program unrolled per step (every step priced on its
  own under the same ``CostModel``; equal to the scan solver's objective), the loop's is the
  optimum of the Python-loop program traced and solved as its own program under that model.
  Measured while writing this (torch 2.13): 0.3846 / 0.3855 ms at N=1 (0.998), 0.5512 / 0.5523
  (0.998) at 2, 0.8796 / 0.8835 (0.996) at 4, 1.5317 / 1.5519 (0.987) at 8; before (issue 24)
  0.4600 vs 0.3876 at 1 and 1.974 vs 1.574 at 8. The gap was charges a real run does not pay (per-step reductions
  of stacked ys a stack keeps pending; a second reduction of values that left their graph whole;
  per-slice, per-step layouts of stacked xs the lowering lays out once; view copies priced as
  copies) and the tie of a carry's input layout to its output's (now free, the init redistributed
  once and the carry between steps);
- the memory budget: half of what the unconstrained plan keeps per device (parameters with
  gradients and Adam state, inputs, saved activations; far below their replicated footprint)
  makes the solver shard more at some cost; the solution's reported memory is within it; a
  budget below the smallest footprint is refused; the budgeted solve takes at most 3x the
  unbudgeted one's seconds (both on the graph already built);
- the search policies on the N=1 scan problem: ``search="exact"`` and ``"auto"``, with and
  without the eliminations (one optimum).

The anchor (autoparallel, its own ILP over the unrolled joint graph with PuLP/CBC, torch 2.15,
same model and mesh, measured on this machine kind and quoted in the issue): 320k variables /
64 s at 1 layer; with repeated-layer clustering 573k variables / 308 s at 32 layers.

Then production shapes, each solved in a fresh process (its peak host memory is its own), the
model built on the meta device (``with torch.device("meta")``: no parameter is ever
materialized) and the plan applied to the program:

  llama3-8b  @ 8x8    ("data", "model")            dim 4096, 32 layers, FFN 14336
  llama3-8b  @ 4x4x4  ("data", "fsdp", "tensor")
  llama3-70b @ 8x8x8  ("data", "fsdp", "tensor")   dim 8192, 80 layers, FFN 28672

(32 / 64 heads, 8 kv heads, vocab 128256, batch 64, seq 2048), each at full depth and at one
layer. Printed: variables (of the largest integer program solved), the exact program's size
(``problem``: on 3-D meshes the pair variables the axis search stands for), trace / graph /
build / solve / apply seconds, end to end, peak RSS (``VmHWM``), next to autoparallel's
published figures where there are some. Bars: end to end <= 10 s, peak RSS < 2 GB, problem
variables at one layer == at full depth.

Known (quiet 2-core machine, torch 2.13, issue 24's last session): 8B on 8x8 is solved exactly,
74,930 variables at 1 and 32 layers, 3.7 s end to end, 0.55 GB. On 3-D meshes a rank-4
activation has up to 7^3 layouts and the exact program has 1.64M pair variables after the
reductions (the same at every depth), so the solver searches mesh-axis neighbourhoods
(``passes.solver.search._axis_search``: a coarse level with two axes tied, then every choice's
one-axis changes and every two-axis plane, solved at once, largest first): 8B on 4x4x4 7.9 s
(trace 2.4, graph 1.9, build 0.8, solve 2.7), 70B on 8x8x8 8.1 s (2.8 / 1.9 / 0.8 / 2.6), peak
RSS 0.73-0.83 GB (at one layer: 9.8 and 8.3 s, the search running more rounds before no
neighbourhood improves); the largest neighbourhood program follows the plan (70B: 71,433 variables at
80 layers, 71,512 at 1). 8B on 4x4x4 at one layer: the search's plan costs 0.1978740 s, the
exact program's proven optimum (``search="exact"``: 1.66M variables, 32 s of HiGHS). Bars: all pass but "solved to optimality", which fails by
construction on 3-D meshes (the status says "not proven optimal"). Before issue 24's last
session: 12.5 s and 14.6 s (the trace traced the scan step's joint in both of AOTAutograd's
passes; the planes were solved one after the other; HiGHS presolved every program).

Usage: python benchmarks/solver_scaling.py [--layers 1,2,4,8,16,32] [--unrolled-up-to 32]
       python benchmarks/solver_scaling.py --production-only
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import hops
import passes
from passes.solver import CostModel
from passes.solver.solve import evaluate_placements, solve_graph
from passes.solver.unrolled import scan_plan_on_unrolled, unrolled_graph

ANCHOR = {"variables_1": 320_000, "seconds_1": 64.0, "variables_32": 573_000, "seconds_32": 308.0}


def load_example():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "auto_shard.py")
    spec = importlib.util.spec_from_file_location("auto_shard", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


example = load_example()
MESH = hops.Mesh((8, 8), ("data", "model"))
COST_MODEL = CostModel.preset("h100")


def config(layers: int):
    return example.Config(dim=256, heads=16, kv_heads=4, vocab=2048, ffn=768, layers=layers, batch=16, seq=512)


def make_losses(cfg):
    """(scanned loss, unrolled loss) of the example's decoder."""
    return example.make_loss(cfg, MESH), example.make_loss(cfg, MESH, unrolled=True)


def end_to_end(loss, cfg, **solve_options):
    with torch.device("meta"):
        inputs = example.example_inputs(cfg)  # shapes only: the program's inputs are never made
    gc.collect()
    start = time.perf_counter()
    graphs = example.trace_training_step(loss, *inputs)
    traced = time.perf_counter()
    graph = passes.placement_graph(graphs, MESH)
    placed = time.perf_counter()
    solution = solve_graph(graph, cost_model=COST_MODEL, graph_seconds=placed - traced, **solve_options)
    total = time.perf_counter() - start
    return dict(
        solution=solution,
        trace=traced - start,
        graph=placed - traced,
        build=solution.stats["build_seconds"],
        solve=solution.stats["solve_seconds"],
        total=total,
        variables=solution.stats["variables"],
        nodes=graph.number_of_nodes(),
    )


# --------------------------------------------------------------------------- production shapes

LLAMA3_8B = dict(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, batch=64, seq=2048)
LLAMA3_70B = dict(LLAMA3_8B, dim=8192, layers=80, heads=64, ffn=28672)
PRODUCTION = {
    "llama3-8b@8x8": (LLAMA3_8B, ((8, 8), ("data", "model"))),
    "llama3-8b@4x4x4": (LLAMA3_8B, ((4, 4, 4), ("data", "fsdp", "tensor"))),
    "llama3-70b@8x8x8": (LLAMA3_70B, ((8, 8, 8), ("data", "fsdp", "tensor"))),
}
# autoparallel on LLaMA-3 8B, 32 layers, 64 GPUs, 2-D mesh, repeated-layer clustering:
# 3.67M decision variables (meta-pytorch/autoparallel#357), ILP build 15.1 s + solve 36.5 s
# (#438); search total 46.8 s at 2.76 GiB RSS (#521). Nothing published for the others.
AUTOPARALLEL = {
    "llama3-8b@8x8": "3.67M variables, build 15.1 s + solve 36.5 s (#357, #438); 46.8 s, 2.76 GiB RSS (#521)",
}


SOLVE_LIMIT = 60.0  # seconds the MILP solver gets per production shape (beyond it: reported as no plan)


def peak_rss() -> float:
    """This process's peak resident bytes since it started its program: ``VmHWM`` (a new
    address space at exec), not ``ru_maxrss``, which a child started by a large parent inherits
    from it on Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_production(name: str, layers: int | None = None) -> dict:
    """Trace, graph, build, solve and apply one production shape in this process."""
    from torch._subclasses.fake_tensor import FakeTensor

    shape, (mesh_shape, axis_names) = PRODUCTION[name]
    cfg = example.Config(**dict(shape, **({"layers": layers} if layers else {})))
    mesh = hops.Mesh(mesh_shape, axis_names)
    loss = example.make_loss(cfg, mesh)
    with torch.device("meta"):
        inputs = example.example_inputs(cfg)
    start, cpu = time.perf_counter(), time.process_time()
    graphs = example.trace_training_step(loss, *inputs)
    traced = time.perf_counter()
    graph = passes.placement_graph(graphs, mesh)
    placed = time.perf_counter()
    try:
        solution = solve_graph(graph, cost_model=COST_MODEL, graph_seconds=placed - traced, time_limit=SOLVE_LIMIT)
    except RuntimeError as error:  # no plan within the time limit: say so, with how far it got
        return dict(
            name=name, layers=cfg.layers, error=str(error)[:200], trace=traced - start, graph=placed - traced,
            total=time.perf_counter() - start, cpu=time.process_time() - cpu,
            peak_rss=peak_rss(),
        )
    solved = time.perf_counter()
    passes.apply_placements(graphs, solution)
    applied = time.perf_counter()
    materialized = [
        node.name for gm in graphs for node in gm.graph.find_nodes(op="placeholder")
        if "val" in node.meta and not isinstance(node.meta["val"], FakeTensor)
    ]
    return dict(
        name=name, layers=cfg.layers, variables=solution.stats["variables"], status=solution.stats["status"],
        # The exact program's size: searched by axes, its pair variables after the reductions
        # (the neighbourhoods' programs, ``variables``, follow the plan); else ``variables``.
        problem=solution.stats.get("exact_pair_variables") or solution.stats["variables"],
        trace=traced - start, graph=placed - traced, build=solution.stats["build_seconds"],
        solve=solution.stats["solve_seconds"], apply=applied - solved, total=applied - start,
        cpu=time.process_time() - cpu,
        peak_rss=peak_rss(), materialized=materialized,
        parameters=sum(math.prod(v.shape) for v in inputs[2].values()),
    )


def production_in_subprocess(name: str, layers: int | None = None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--one", name] + (["--one-layers", str(layers)] if layers else [])
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def production() -> list[tuple[str, bool, str]]:
    print("\n# production shapes, each in a fresh process, the model on the meta device (h100 cost model)")
    print(
        "(seconds are wall time; 'cpu': this process's CPU seconds over the same span, which a shared machine's "
        "load does not inflate)"
    )
    print(
        "('variables': of the largest integer program solved; 'problem': of the exact program, which a search by "
        "axes stands for)"
    )
    print(
        "shape              layers  params variables   problem   trace   graph   build   solve   apply   total     cpu  peak RSS"
    )
    bars = []
    for name in PRODUCTION:
        full = production_in_subprocess(name)
        one = production_in_subprocess(name, 1)
        for r in (full, one):
            if "error" in r:
                print(
                    f"{r['name']:18s} {r['layers']:6d} trace {r['trace']:.2f} s, graph {r['graph']:.2f} s, then no plan: "
                    f"{r['error']} ({r['total']:.2f} s, {r['cpu']:.2f} s CPU, peak RSS {r['peak_rss'] / 2**30:.2f} GiB)",
                    flush=True,
                )
                continue
            print(
                f"{r['name']:18s} {r['layers']:6d} {r['parameters'] / 1e9:6.1f}B {r['variables']:9d} {r['problem']:9d} {r['trace']:7.2f} "
                f"{r['graph']:7.2f} {r['build']:7.2f} {r['solve']:7.2f} {r['apply']:7.2f} {r['total']:7.2f} {r['cpu']:7.2f} "
                f"{r['peak_rss'] / 2**30:6.2f} GiB  {r['status'][:40]}",
                flush=True,
            )
        print(f"{'':18s} autoparallel: {AUTOPARALLEL.get(name, 'no published figure')}")
        if "error" in full or "error" in one:
            bars.append((f"{name} solved", False, (full.get("error") or one.get("error"))[:120]))
            continue
        bars += [
            (f"{name} solved to optimality", full["status"] == "optimal", full["status"][:60]),
            (f"{name} end to end <= 10 s", full["total"] <= 10.0, f"{full['total']:.2f} s ({full['cpu']:.2f} s CPU)"),
            (f"{name} peak RSS < 2 GB", full["peak_rss"] < 2e9 and not full["materialized"],
             f"{full['peak_rss'] / 1e9:.2f} GB, materialized inputs: {full['materialized'] or 'none'}"),
            (f"{name} problem variables at 1 layer == at {full['layers']}", one["problem"] == full["problem"],
             f"{one['problem']} vs {full['problem']} (largest program solved: {one['variables']} vs {full['variables']})"),
        ]
    return bars


def row(kind, layers, r):
    return (
        f"{kind:9s} {layers:3d} {r['nodes']:6d} {r['variables']:9d} {r['trace']:7.2f} {r['graph']:7.2f} "
        f"{r['build']:7.2f} {r['solve']:7.2f} {r['total']:7.2f} {r['solution'].cost * 1e3:10.4f}"
    )


def replicated_footprint(graph):
    """Bytes per device of parameters (with gradient and optimizer state), inputs and saved
    activations when every one of them is replicated."""
    factor = {"parameter": 2.0 + COST_MODEL.optimizer_state_bytes, "input": 1.0, "activation": 1.0}
    total = 0.0
    for _, data in graph.nodes(data=True):
        if data.get("role") and data["shape"] is not None:
            itemsize = torch.empty((), dtype=data["dtype"]).element_size()
            total += factor[data["role"]] * itemsize * float(torch.Size(data["shape"]).numel())
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="1,2,4,8,16,32")
    parser.add_argument("--unrolled-up-to", type=int, default=32)
    parser.add_argument("--production-only", action="store_true", help="only the production shapes")
    parser.add_argument("--one", choices=sorted(PRODUCTION), help=argparse.SUPPRESS)  # one shape, as JSON
    parser.add_argument("--one-layers", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    layer_counts = [int(n) for n in args.layers.split(",")]
    torch.set_num_threads(1)
    if args.one:
        # Untimed first: imports and DTensor's rule tables, on a one-layer toy of the same mesh.
        shape, (mesh_shape, axis_names) = PRODUCTION[args.one]
        toy = example.Config(layers=1, batch=math.prod(mesh_shape), heads=max(mesh_shape), kv_heads=1, dim=8 * max(mesh_shape))
        toy_mesh = hops.Mesh(mesh_shape, axis_names)
        with torch.device("meta"):
            toy_inputs = example.example_inputs(toy)
        passes.placement_graph(example.trace_training_step(example.make_loss(toy, toy_mesh), *toy_inputs), toy_mesh)
        print(json.dumps(run_production(args.one, args.one_layers)))
        return
    if args.production_only:
        for name, ok, detail in production():
            print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        return
    print(f"torch {torch.__version__}, mesh {dict(zip(MESH.axis_names, MESH.shape))}, cost model {COST_MODEL.name}")
    # One untimed run first: imports, DTensor's rule tables and the fake process group are
    # made once per process, and would otherwise count against whichever N runs first.
    end_to_end(make_losses(config(1))[0], config(1))
    print("kind      N    nodes variables   trace   graph   build   solve   total  cost (ms)")
    results: dict[tuple[str, int], dict] = {}
    for layers in layer_counts:
        cfg = config(layers)
        scanned, unrolled = make_losses(cfg)
        results["scan", layers] = end_to_end(scanned, cfg)
        print(row("scan", layers, results["scan", layers]), flush=True)
        if layers <= args.unrolled_up_to:
            results["unrolled", layers] = end_to_end(unrolled, cfg)
            print(row("unrolled", layers, results["unrolled", layers]), flush=True)

    # T(last)/T(first): the machine is shared, so first and last alternate three more times and
    # the medians (table run included) are compared.
    first, last = layer_counts[0], layer_counts[-1]
    times = {first: [results["scan", first]["total"]], last: [results["scan", last]["total"]]}
    for _ in range(3):
        for layers in (first, last):
            times[layers].append(end_to_end(make_losses(config(layers))[0], config(layers))["total"])
    medians = {layers: statistics.median(t) for layers, t in times.items()}
    print(
        f"\n# end to end, scan, alternating: N={first} {[round(t, 2) for t in times[first]]} s, "
        f"N={last} {[round(t, 2) for t in times[last]]} s; medians {medians[first]:.2f} / {medians[last]:.2f} s"
    )

    print("\n# quality: the scan plan measured on the scan program unrolled per step")
    quality = {}
    for layers in (2, 4):
        if ("scan", layers) not in results:
            continue
        solution = results["scan", layers]["solution"]
        unrolled, origin = unrolled_graph(solution.graph)
        start = time.perf_counter()
        measured = evaluate_placements(unrolled, scan_plan_on_unrolled(unrolled, origin, solution), COST_MODEL)
        optimum = solve_graph(unrolled, cost_model=COST_MODEL)
        quality[layers] = measured / optimum.cost
        print(
            f"N={layers}: scan plan {measured * 1e3:.4f} ms, unrolled optimum {optimum.cost * 1e3:.4f} ms "
            f"({optimum.stats['variables']} variables, {time.perf_counter() - start:.1f} s): ratio {quality[layers]:.5f}"
        )
        if ("unrolled", layers) in results:
            loop = results["unrolled", layers]["solution"].cost
            print(f"      (the Python-loop program's own optimum: {loop * 1e3:.4f} ms)")

    print("\n# plan quality: the scan plan against the unrolled (Python-loop) program's optimum, same cost model")
    print("(scan plan: evaluated on the scan program unrolled per step, each step priced on its own)")
    against_loop = {}
    for layers in (1, 2, 4, 8):
        if ("scan", layers) not in results or ("unrolled", layers) not in results:
            continue
        solution = results["scan", layers]["solution"]
        unrolled, origin = unrolled_graph(solution.graph)
        measured = evaluate_placements(unrolled, scan_plan_on_unrolled(unrolled, origin, solution), COST_MODEL)
        loop = results["unrolled", layers]["solution"].cost
        against_loop[layers] = measured / loop
        print(
            f"N={layers}: scan plan {measured * 1e3:.4f} ms (scan objective {solution.cost * 1e3:.4f}), "
            f"unrolled program's optimum {loop * 1e3:.4f} ms: ratio {against_loop[layers]:.4f}"
        )

    print("\n# memory budget (N=4, scan)")
    budget_layers = 4 if ("scan", 4) in results else layer_counts[0]
    free = results["scan", budget_layers]["solution"]
    footprint = replicated_footprint(free.graph)
    budget = free.memory / 2  # below what the unconstrained plan keeps, itself below the replicated footprint
    began = time.perf_counter()
    solve_graph(free.graph, cost_model=COST_MODEL)
    free_seconds = time.perf_counter() - began
    began = time.perf_counter()
    bound = solve_graph(free.graph, cost_model=COST_MODEL, memory_budget=budget)
    budget_ratio = (time.perf_counter() - began) / free_seconds
    roles = [k for k, d in free.graph.nodes(data=True) if d.get("role") in ("parameter", "activation")]

    def sharded(solution):
        return sum(1 for k in roles if any(not isinstance(p, hops.Replicate) for p in solution.placements.get(k, ())))

    print(
        f"replicated footprint {footprint / 2**20:.1f} MiB per device; unconstrained plan {free.memory / 2**20:.1f} MiB, "
        f"{free.cost * 1e3:.4f} ms, {sharded(free)}/{len(roles)} parameters and saved activations sharded"
    )
    print(
        f"budget {budget / 2**20:.1f} MiB: plan {bound.memory / 2**20:.1f} MiB, {bound.cost * 1e3:.4f} ms "
        f"(+{(bound.cost / free.cost - 1) * 100:.2f}%), {sharded(bound)}/{len(roles)} sharded; "
        f"{budget_ratio:.2f}x the unbudgeted solve's seconds ({free_seconds:.2f} s)"
    )
    try:
        solve_graph(free.graph, cost_model=COST_MODEL, memory_budget=footprint / 1000)
        refused = "not refused"
    except passes.InfeasiblePlacementError as error:
        refused = f"refused: {str(error)[:110]}..."
    print(f"budget {footprint / 1000 / 2**20:.2f} MiB: {refused}")
    budget_ok = bound.memory <= budget < free.memory < footprint and refused.startswith("refused")

    print("\n# search policies on the N=1 scan problem")
    graph_1 = results["scan", layer_counts[0]]["solution"].graph
    for search, reduce in (("auto", True), ("exact", True), ("exact", False)):
        solution = solve_graph(graph_1, cost_model=COST_MODEL, search=search, reduce=reduce)
        print(
            f"search={search:5s} reduce={reduce!s:5s} solve {solution.stats['solve_seconds']:6.2f} s, "
            f"{solution.stats['variables']} variables, optimum {solution.cost * 1e3:.6f} ms"
        )

    scan_first, scan_last = results["scan", first], results["scan", last]
    ratio = medians[last] / medians[first]
    bars = [
        (f"scan variables N={last} == N={first}", scan_last["variables"] == scan_first["variables"],
         f"{scan_last['variables']} vs {scan_first['variables']}"),
        (f"T({last})/T({first}) <= 1.2 (medians)", ratio <= 1.2, f"{ratio:.3f}"),
        (f"N={last} end to end <= 15 s (median)", medians[last] <= 15.0,
         f"{medians[last]:.2f} s (anchor with clustering: {ANCHOR['seconds_32']:.0f} s)"),
        *(
            (f"quality N={n} within 1%", q <= 1.01, f"{(q - 1) * 100:.3f}%")
            for n, q in quality.items()
        ),
        *(
            (f"scan plan <= 1.02x the unrolled program's optimum at N={n}", r <= 1.02, f"ratio {r:.4f}")
            for n, r in against_loop.items()
        ),
        ("budgeted solve <= 3x the unbudgeted solve's time", budget_ratio <= 3.0, f"{budget_ratio:.2f}x"),
        ("memory budget binds, holds, and an infeasible one is refused", budget_ok,
         f"{bound.memory / 2**20:.1f} <= {budget / 2**20:.1f} < {free.memory / 2**20:.1f} MiB unconstrained"),
    ]
    bars += production()
    print("\n# bars")
    for name, ok, detail in bars:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print(
        f"\nvariables vs the anchor: N=1 {scan_first['variables']} vs {ANCHOR['variables_1']} "
        f"({ANCHOR['variables_1'] / max(scan_first['variables'], 1):.1f}x fewer); N=32 "
        f"{scan_last['variables']} vs {ANCHOR['variables_32']} (clustered)"
    )


if __name__ == "__main__":
    main()
