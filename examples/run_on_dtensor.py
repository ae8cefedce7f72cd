"""Run the examples on DTensor: real processes, gloo on CPU, forward and backward.

    python examples/run_on_dtensor.py [EXAMPLE ...]
    torchrun --nproc-per-node 4 examples/run_on_dtensor.py [EXAMPLE ...]

Run plainly, it starts the 4 local processes itself (gloo on 127.0.0.1, a free port);
under ``torchrun`` (``RANK`` set) each process it starts runs one rank. ``EXAMPLE``: the
names in ``PLANS`` to run (default: all).

Each example (the sharded MLP, local_map attention, the scanned layers, and the solver's
decoder) is traced with AOTAutograd on CPU, exactly as for XLA; ``passes.lower_to_dtensor``
lowers its forward and backward graphs for a 2x2 ``DeviceMesh`` ("data", "model"); the inputs
and parameters are distributed as DTensors (``distribute_tensor``) and the graphs run on 4
processes. Every rank checks the loss and every gradient (``full_tensor()``) against
single-device eager PyTorch. The decoder's placements come from ``passes.solve_placements``;
its collectives (``CommDebugMode``) are printed next to those the solution predicts
(``PlacementSolution.collectives``). Making an example's plan (``PLANS``) needs no process
group; ``run_plan`` lowers and runs it. The same program runs on GPUs with
``init_process_group("nccl")`` and a ``"cuda"`` DeviceMesh. No torch_xla is needed.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import passes  # noqa: E402
from hops import Mesh, Replicate, Shard  # noqa: E402

WHOLE = (Replicate(), Replicate())
MESH = Mesh.of(data=2, model=2)


# --------------------------------------------------------------------------- plans (no process group)
#
# A plan is what every rank runs: the traced (and, for the solver, annotated) forward and
# backward graphs, the inputs and their placements, the eager loss and gradients to compare
# with. Making one needs no process group, so one process can make it for all ranks (it is
# picklable); ``run_plan`` lowers and runs it on each rank.


def _reference(loss_fn, inputs, positions):
    """The eager loss of ``loss_fn(*inputs)`` and its gradients at ``positions``."""
    leaves = [t.detach().clone().requires_grad_(i in positions) for i, t in enumerate(inputs)]
    loss = loss_fn(*leaves)
    loss.backward()
    return loss.detach(), {i: leaves[i].grad for i in positions}


def plan_sharded_mlp() -> dict:
    import sharded_mlp as example

    torch.manual_seed(0)
    model, x = example.MLP(), torch.randn(8, 16)
    forward, backward = example.trace(model, x)
    model.zero_grad()
    reference = model(x).square().mean()
    reference.backward()
    return dict(
        mesh=example.MESH, forward=forward, backward=backward, inputs=[model.up.detach(), model.down.detach(), x],
        placements=[WHOLE, WHOLE, example.BATCH.placements], loss=reference.detach(),
        grads={0: model.up.grad, 1: model.down.grad}, tolerance={},
    )


def plan_local_map_attention() -> dict:
    import local_map_attention as example

    args = example.inputs()
    forward, backward = example.aot_graphs(*args)
    loss, grads = _reference(lambda *a: example.single_device_block(*a).square().mean(), args, range(len(args)))
    return dict(
        mesh=example.MESH,  # its axes are ("data", "context")
        forward=forward, backward=backward, inputs=list(args), placements=[example.QUERIES, *[WHOLE] * 4],
        loss=loss, grads=grads, tolerance={},
    )


def plan_scan_layers() -> dict:
    import scan_layers as example

    args = example.inputs()
    forward, backward = example.aot_graphs(args)
    loss, grads = _reference(example.unrolled_loss, args, range(len(args)))
    return dict(
        mesh=example.MESH, forward=forward, backward=backward, inputs=list(args),
        placements=[(Shard(0), Replicate()), WHOLE, WHOLE], loss=loss, grads=grads,
        tolerance=dict(rtol=1e-4, atol=1e-5),
    )


def plan_auto_shard(config=None, mesh: Mesh = MESH, *, device_type: str = "cpu") -> dict:
    """The solver's decoder: solved, the plan applied as annotations; the inputs laid out as
    solved. ``predicted``: the collectives the solution says each graph issues on a
    ``device_type`` mesh (``PlacementSolution.collectives``)."""
    import auto_shard as example

    config = config or example.Config()
    loss = example.make_loss(config, mesh)
    tokens, targets, params, consts = example.example_inputs(config)
    forward, backward = example.trace_training_step(loss, tokens, targets, params, consts)
    solution = passes.solve_placements((forward, backward), mesh, cost_model=passes.CostModel.preset("tpu-v5e"))
    passes.apply_placements((forward, backward), solution, pending_sums=True)
    inputs = [tokens, targets, *params.values(), *consts.values()]
    placeholders = [node.name for node in forward.graph.find_nodes(op="placeholder")]
    names = list(params)

    def flat_loss(tokens, targets, *tensors):
        return loss(tokens, targets, dict(zip(names, tensors[: len(names)])), dict(zip(consts, tensors[len(names) :])))

    reference, grads = _reference(flat_loss, inputs, range(2, 2 + len(params)))
    return dict(
        mesh=mesh, forward=forward, backward=backward, inputs=inputs,
        placements=[solution.placements[f"forward/{name}"] for name in placeholders],
        loss=reference, grads=grads, tolerance=dict(rtol=1e-4, atol=1e-5),
        predicted={graph: solution.collectives(graph, device_type=device_type) for graph in ("forward", "backward")},
    )


PLANS = {
    "sharded_mlp": plan_sharded_mlp,
    "local_map_attention": plan_local_map_attention,
    "scan_layers": plan_scan_layers,
    "auto_shard": plan_auto_shard,
}


# --------------------------------------------------------------------------- running a plan

_DEVICE_MESHES: dict = {}


def device_mesh_for(mesh: Mesh):
    """One DeviceMesh per ``hops.Mesh`` in this process (each makes process groups)."""
    if mesh not in _DEVICE_MESHES:
        _DEVICE_MESHES[mesh] = mesh.to_device_mesh()
    return _DEVICE_MESHES[mesh]


def run_plan(plan: dict) -> dict:
    """Lower the plan's graphs for its mesh, run them on its inputs distributed per its
    placements, and check the loss and the gradients (those in ``plan["grads"]``, by position)
    against eager. Returns the collectives each graph issued (``passes.dtensor.collective_counts``)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import ones as dtensor_ones
    from torch.distributed.tensor.debug import CommDebugMode

    from passes.dtensor import collective_counts

    device_mesh = device_mesh_for(plan["mesh"])
    forward, backward = plan["forward"], plan["backward"]
    passes.lower_to_dtensor(forward, device_mesh)
    passes.lower_to_dtensor(backward, device_mesh)
    distributed = [
        distribute_tensor(t, device_mesh, [p.to_dtensor() for p in ps]) for t, ps in zip(plan["inputs"], plan["placements"])
    ]
    with CommDebugMode() as forward_comms, torch.no_grad():
        loss, *saved = forward(*distributed)
    with CommDebugMode() as backward_comms, torch.no_grad():
        # The loss's cotangent is whole on every rank (the loss itself may be a pending sum).
        grads = backward(*saved, dtensor_ones((), device_mesh=device_mesh, placements=[Replicate().to_dtensor()] * device_mesh.ndim))
    torch.testing.assert_close(loss.full_tensor(), plan["loss"], **plan["tolerance"])
    for position, want in plan["grads"].items():
        torch.testing.assert_close(grads[position].full_tensor(), want, msg=f"gradient {position}", **plan["tolerance"])
    return {"forward_comms": collective_counts(forward_comms), "backward_comms": collective_counts(backward_comms)}


def run(names: list[str]) -> None:
    """This rank's part: every plan in ``names`` made, lowered, run and checked (the
    process group from the environment ``torchrun`` or ``spawn`` sets)."""
    dist.init_process_group("gloo")
    device_mesh = MESH.to_device_mesh()
    _DEVICE_MESHES[MESH] = device_mesh
    for name in names:
        plan = PLANS[name]()
        counts = run_plan(plan)
        if dist.get_rank() == 0:
            predicted = f" (the solver predicted {plan['predicted']})" if "predicted" in plan else ""
            print(f"{name}: loss and gradients match single-device eager; collectives {counts}{predicted}", flush=True)
    dist.destroy_process_group()


WORLD_SIZE = MESH.size


def _rank(rank: int, port: int, names: list[str]) -> None:
    """One of the processes ``spawn`` starts: rank ``rank`` of ``WORLD_SIZE`` on this host."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE)
    )
    run(names)


def spawn(names: list[str]) -> None:
    """Start the ``WORLD_SIZE`` local processes (what ``torchrun`` would) and wait for them."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The ranks are CPU programs: no out-of-tree device backend (torch_xla) loaded by `import torch`.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    mp.start_processes(_rank, args=(port, names), nprocs=WORLD_SIZE, start_method="spawn")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Run the examples on DTensor (4 gloo processes on CPU).")
    parser.add_argument("examples", nargs="*", metavar="EXAMPLE", help=f"any of {', '.join(PLANS)} (default: all)")
    names = parser.parse_args(argv).examples or list(PLANS)
    unknown = [name for name in names if name not in PLANS]
    if unknown:
        parser.error(f"unknown EXAMPLE {', '.join(map(repr, unknown))}; choose from {', '.join(PLANS)}")
    if "RANK" in os.environ:  # started by torchrun (or another launcher): this process is one rank
        run(names)
    else:
        spawn(names)


if __name__ == "__main__":
    main()
