"""The solver core on the FX front's own problems, a family of model shapes, meshes and budgets.

Each problem is ``examples/auto_shard.py``'s decoder traced as a training step (built on the
meta device), placed on a mesh (``passes.placement_graph``) and priced by the ``h100`` cost
model (``passes.solver.solve.placement_problem``), with no memory budget or with one a share of
the way from the least footprint any placement allows to the peak of the unbudgeted optimum
(``--budgets 0.5``: half way). Every problem goes through the contest's format
(``write_iopddl`` with costs in picoseconds, then ``read_iopddl``; ``--write DIR`` keeps the
files, for other solvers), so it is solved as the contest's instances are: without the
mesh-axis codes. Per problem this prints the cost ``solve_problem`` reaches within
``--time-limit`` relative to a reference (the same call with ``--reference-limit``, or the
cheaper of the two), the reference's status, and the seconds taken. Every plan is checked by
``problem_cost`` and ``peak_usage``.

Measured (idle 2-core machine, torch 2.13 venv, ``--shapes 128x2 --meshes 2x2,2x4,2x2x2
--reference-limit 60``), before and after commit "solver: a neighbourhood of values, each node
restricted to the strategies the dual ranks first" (each run's reference is its own 60 s call):

| shape | mesh | budget | nodes | before: 10 s / reference | after: 10 s / reference | after: reference (60 s) | dual first: 10 s / reference |
|---|---|---|---|---|---|---|---|
| 128x2 | 2x2 | none | 478 | 1.0000 | 1.0000 | optimal (1.0 s) | 1.0000 |
| 128x2 | 2x2 | 0.5 | 478 | 1.1052 | 1.1061 | optimal (31 s) | 1.0600 |
| 128x2 | 2x2 | 0.2 | 478 | 1.1442 | 1.2436 | not proven | 1.1326 |
| 128x2 | 2x4 | none | 478 | 1.0000 | 1.0000 | optimal (1.3 s) | 1.0000 |
| 128x2 | 2x4 | 0.5 | 478 | 1.1280 | 1.0904 | not proven | 1.0506 |
| 128x2 | 2x4 | 0.2 | 478 | 1.1624 | 1.0148 | not proven | 1.0148 |
| 128x2 | 2x2x2 | none | 478 | 1.4179 | 1.0106 | not proven | 1.0106 |
| 128x2 | 2x2x2 | 0.5 | 478 | 1.2252 | 1.0176 | not proven | 1.0176 |
| 128x2 | 2x2x2 | 0.2 | 478 | 1.4557 | 1.0476 | not proven | 1.0476 |

Geometric mean 1.1727 before, 1.0565 after; worst 1.4557, then 1.2436. Every call kept its limit.

"Dual first": after commit "solver: where memory binds, the dual-restricted programs run before
the whole program, not after" (the whole program over a small budgeted problem had spent half
the time without improving the plan): geometric mean 1.0363, worst 1.1326. The 2x2 0.5 row's
60 s reference is no longer proven optimal in 60 s (the program gets half of what the bound and
the dual programs leave); giving it back its share before them proves it again (in 36 s) but
cost 3% at 10 s over 18 budgeted problems (worst 1.17x), so it was left out.

**Many strategies on a 3-D mesh.** This mesh has 105 strategies per value and 3.25M pair
variables, and the contest's format drops the mesh-axis codes. A node neighbourhood of 20k pair
variables is then a few edges, so it cannot move the layouts of many values together.
- Before: 3.76e8 at 10 s and 2.65e8 at 60 s.
- The FX front's own solve reaches 2.49e8 in 9 s, using the codes.
- Larger first neighbourhoods (100k, 300k pair variables) did not help.
- What did help is the dual-restricted program: every node limited to the few strategies the
  bound's diffusion ranks first, solved whole. It reaches 2.49e8 in under a second once the
  ranking has had its time.

**A budget shared by every step.** Parameters and optimizer state live throughout, so the
budget binds every step at once.
- The whole-program integer program with memory rows does not finish in half of 10 s.
- The priced rounds get no round of their least length.
- Shorter rounds for every problem were tried and left out. They gave 1.00-1.07x on four of
  five budgeted problems, but 1.44x on a 2x2x2 one, and lost 3-8% on contest-like problems of
  2-8k nodes at 10 s.
- The 2x2 0.2 row varies most between runs: 1.02-1.24x at 10 s over three runs of this change
  as it was tuned (before it: 1.14-1.23x over four runs).

The FX front itself solves without a time limit by default: to the proven optimum, or by the
mesh-axis policy on 3-D meshes, in the times ``benchmarks/solver_scaling.py`` prints.

Usage: python benchmarks/solver_fx_family.py [--shapes 128x2,256x1] [--meshes 2x2,2x4,2x2x2]
       [--budgets none,0.5,0.2] [--time-limit 10] [--reference-limit 90] [--write DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import hops  # noqa: E402
import passes  # noqa: E402
from passes.solver import CostModel, NoPlanFoundError, peak_usage, problem_cost, read_iopddl, solve_problem, write_iopddl  # noqa: E402
from passes.solver.solve import placement_problem  # noqa: E402

MESHES = {"4": ((4,), ("model",)), "2x2": ((2, 2), ("data", "model")), "2x4": ((2, 4), ("data", "model")),
          "4x4": ((4, 4), ("data", "model")), "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor"))}
COST_SCALE = 1e12  # seconds to picoseconds: the contest's files hold integer costs


def fx_problems(shape: str, mesh_name: str, budgets: list[float | None]):
    """(budget, problem) of the decoder ``DIMxLAYERS`` (unrolled) on the mesh, per budget share."""
    import auto_shard as example  # (examples/, on the path above)
    dim, layers = (int(x) for x in shape.split("x"))
    config = example.Config(dim=dim, heads=8, kv_heads=4, vocab=1024, ffn=3 * dim, layers=layers, batch=8, seq=256)
    mesh = hops.Mesh(*MESHES[mesh_name])
    with torch.device("meta"):
        inputs = example.example_inputs(config)
    graphs = example.trace_training_step(example.make_loss(config, mesh, unrolled=True), *inputs)
    graph = passes.placement_graph(graphs, mesh)
    cost_model = CostModel.preset("h100")
    free, _ = placement_problem(graph, cost_model)
    peak = least = None
    for share in budgets:
        if share is None:
            yield share, free
            continue
        if peak is None:
            peak = peak_usage(free, solve_problem(free).strategies)
            least = peak_usage(free, [int(np.argmin(u)) for u in free.node_usages])
        yield share, placement_problem(graph, cost_model, least + share * (peak - least))[0]


def _through_the_format(problem, folder: str, name: str):
    path = os.path.join(folder, f"{name}.json.gz")
    write_iopddl(problem, path, cost_scale=COST_SCALE, name=name)
    return read_iopddl(path)


def _solved(problem, limit: float):
    began = time.perf_counter()
    try:
        solution = solve_problem(problem, time_limit=limit)
    except NoPlanFoundError:
        return math.inf, "no plan", time.perf_counter() - began
    seconds = time.perf_counter() - began
    cost = problem_cost(problem, solution.strategies)
    assert math.isclose(cost, solution.cost, rel_tol=1e-9), (cost, solution.cost)
    assert problem.usage_limit is None or peak_usage(problem, solution.strategies) <= problem.usage_limit
    return cost, solution.stats.get("status", ""), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="128x2,256x1", help="DIMxLAYERS of the decoder, comma-separated")
    parser.add_argument("--meshes", default="2x2,2x4,2x2x2", help=f"among {sorted(MESHES)}")
    parser.add_argument("--budgets", default="none,0.5,0.2")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--reference-limit", type=float, default=90.0)
    parser.add_argument("--write", default=None, help="keep the contest-format files in this folder")
    args = parser.parse_args()
    budgets = [None if b == "none" else float(b) for b in args.budgets.split(",")]
    folder = args.write or tempfile.mkdtemp(prefix="fx-family-")
    os.makedirs(folder, exist_ok=True)
    print(f"time limit {args.time_limit:g} s against {args.reference_limit:g} s; files in {folder}")
    print("| shape | mesh | budget | nodes | short / reference | short s | reference | reference s |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for shape in args.shapes.split(","):
        for mesh_name in args.meshes.split(","):
            for share, problem in fx_problems(shape, mesh_name, budgets):
                name = f"fx-{shape}-{mesh_name}-{'none' if share is None else share}"
                problem = _through_the_format(problem, folder, name)
                short, _, short_seconds = _solved(problem, args.time_limit)
                reference, status, reference_seconds = _solved(problem, args.reference_limit)
                ratio = short / min(short, reference)
                ratios.append(ratio)
                print(f"| {shape} | {mesh_name} | {share if share is not None else 'none'} | {problem.num_nodes} | "
                      f"{ratio:.4f} | {short_seconds:.1f} | {status} | {reference_seconds:.1f} |", flush=True)
    finite = [r for r in ratios if math.isfinite(r)]
    mean = math.exp(sum(map(math.log, finite)) / len(finite)) if finite else math.nan
    print(f"geometric mean short / reference {mean:.4f}, worst {max(ratios, default=math.nan):.4f}, no plan {len(ratios) - len(finite)}")


if __name__ == "__main__":
    main()
