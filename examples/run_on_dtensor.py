"""Run the examples on DTensor: real processes, gloo on CPU, forward and backward.

    torchrun --nproc-per-node 4 examples/run_on_dtensor.py

Each example (the sharded MLP, local_map attention, the scanned layers, and the solver's
decoder) is traced with AOTAutograd on CPU, exactly as for XLA; ``passes.lower_to_dtensor``
lowers its forward and backward graphs for a 2x2 ``DeviceMesh`` ("data", "model"); the inputs
and parameters are distributed as DTensors (``distribute_tensor``) and the graphs run on 4
processes. Every rank checks the loss and every gradient (``full_tensor()``) against
single-device eager PyTorch. The same program runs on GPUs with ``init_process_group("nccl")``
and a ``"cuda"`` DeviceMesh. No torch_xla is needed.
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


def _comm_kinds(mode) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for op, count in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
            if name.startswith(kind):
                kinds[kind] = kinds.get(kind, 0) + count
    return kinds


def run_lowered(device_mesh, forward, backward, inputs, placements, expected_loss, expected_grads, *, rtol=None, atol=None):
    """Lower ``forward``/``backward`` for ``device_mesh``, run them on ``inputs`` distributed per
    ``placements``, and check the loss and the gradients (those in ``expected_grads``, by
    position) against eager. Returns the collective counts of each graph."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import ones as dtensor_ones
    from torch.distributed.tensor.debug import CommDebugMode

    passes.lower_to_dtensor(forward, device_mesh)
    passes.lower_to_dtensor(backward, device_mesh)
    distributed = [distribute_tensor(t, device_mesh, [p.to_dtensor() for p in ps]) for t, ps in zip(inputs, placements)]
    with CommDebugMode() as forward_comms, torch.no_grad():
        loss, *saved = forward(*distributed)
    with CommDebugMode() as backward_comms, torch.no_grad():
        # The loss's cotangent is whole on every rank (the loss itself may be a pending sum).
        grads = backward(*saved, dtensor_ones((), device_mesh=device_mesh, placements=[Replicate().to_dtensor()] * 2))
    tolerance = {} if rtol is None else {"rtol": rtol, "atol": atol}
    torch.testing.assert_close(loss.full_tensor(), expected_loss, **tolerance)
    for position, want in expected_grads.items():
        torch.testing.assert_close(grads[position].full_tensor(), want, msg=f"gradient {position}", **tolerance)
    return {"forward_comms": _comm_kinds(forward_comms), "backward_comms": _comm_kinds(backward_comms)}


def sharded_mlp(device_mesh) -> dict:
    import sharded_mlp as example

    torch.manual_seed(0)
    model, x = example.MLP(), torch.randn(8, 16)
    forward, backward = example.trace(model, x)
    model.zero_grad()
    reference = model(x).square().mean()
    reference.backward()
    return run_lowered(
        device_mesh, forward, backward, [model.up.detach(), model.down.detach(), x], [WHOLE, WHOLE, example.BATCH.placements],
        reference.detach(), {0: model.up.grad, 1: model.down.grad},
    )


def local_map_attention(device_mesh=None) -> dict:
    import local_map_attention as example

    args = example.inputs()
    forward, backward = example.aot_graphs(*args)
    device_mesh = example.MESH.to_device_mesh()  # its axes are ("data", "context")
    reference = [a.clone().requires_grad_() for a in args]
    loss = example.single_device_block(*reference).square().mean()
    loss.backward()
    return run_lowered(
        device_mesh, forward, backward, list(args), [example.QUERIES, *[WHOLE] * 4],
        loss.detach(), {i: r.grad for i, r in enumerate(reference)},
    )


def scan_layers(device_mesh) -> dict:
    import scan_layers as example

    args = example.inputs()
    forward, backward = example.aot_graphs(args)
    reference = [a.clone().requires_grad_() for a in args]
    loss = example.unrolled_loss(*reference)
    loss.backward()
    return run_lowered(
        device_mesh, forward, backward, list(args), [(Shard(0), Replicate()), WHOLE, WHOLE],
        loss.detach(), {i: r.grad for i, r in enumerate(reference)}, rtol=1e-4, atol=1e-5,
    )


def auto_shard(device_mesh, config=None) -> dict:
    """The solver's decoder: solved, the plan applied, lowered and run. Reports the
    collectives the solution predicts next to those counted."""
    import auto_shard as example

    mesh = Mesh.from_device_mesh(device_mesh)
    config = config or example.Config()
    loss = example.make_loss(config, mesh)
    tokens, targets, params, consts = example.example_inputs(config)
    forward, backward = example.trace_training_step(loss, tokens, targets, params, consts)
    solution = passes.solve_placements((forward, backward), mesh, cost_model=passes.CostModel.preset("tpu-v5e"))
    passes.apply_placements((forward, backward), solution)
    inputs = [tokens, targets, *params.values(), *consts.values()]
    reference_params = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    reference = loss(tokens, targets, reference_params, consts)
    reference.backward()
    report = run_lowered(
        device_mesh, forward, backward, inputs, [WHOLE] * len(inputs), reference.detach(),
        {2 + i: reference_params[name].grad for i, name in enumerate(params)}, rtol=1e-4, atol=1e-5,
    )
    return report


def main() -> None:
    dist.init_process_group("gloo")
    device_mesh = Mesh.of(data=2, model=2).to_device_mesh()
    for name, run in (("sharded_mlp", sharded_mlp), ("local_map_attention", local_map_attention),
                      ("scan_layers", scan_layers), ("auto_shard", auto_shard)):
        counts = run(device_mesh)
        if dist.get_rank() == 0:
            print(f"{name}: loss and gradients match single-device eager; collectives {counts}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
