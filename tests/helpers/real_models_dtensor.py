"""One rank of ``tests/test_real_models.py``'s DTensor run: the solver's plans of the real models
lowered with ``passes.lower_to_dtensor`` and run on 4 gloo processes.

    python tests/helpers/real_models_dtensor.py OUTDIR NAME [NAME ...]

(run by the test, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set.) For
each model ``NAME`` the test's process writes ``OUTDIR/NAME.pkl``: the training step's graph
(loss and every parameter's gradient, traced by ``make_fx``, solved on the 2x2 mesh and the plan
applied as annotations), its inputs with their solved placements, and the plain model's loss and
gradients. This rank lowers the graph, lays the inputs out (``distribute_tensor``), runs it and
compares the loss and every gradient (``full_tensor()``) with the plain model's; it writes
``OUTDIR/rank<r>.json``: per model ``None`` or the error's traceback. A plan may instead hold
a ``torch.export`` program of the loss (``run_program``), run with ``loss.backward()``.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import time
import traceback

import torch
import torch.distributed as dist

# Run as a script, this file finds the repository (for ``tests.helpers``).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import passes  # noqa: E402
from tests.helpers import real_models as rm  # noqa: E402

PLAN_WAIT_SECONDS = 240


def plan_path(outdir: str, name: str) -> str:
    return os.path.join(outdir, f"{name}.pkl")


def write_plan(outdir: str, name: str, make_plan) -> None:
    """``make_plan()`` (or the error making it) pickled where the ranks wait for it."""
    try:
        payload = pickle.dumps({"plan": make_plan()})
    except Exception:  # the ranks report it for this model
        payload = pickle.dumps({"error": traceback.format_exc()})
    path = plan_path(outdir, name)
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)  # a rank never reads half a file


def load_plan(outdir: str, name: str) -> dict:
    path = plan_path(outdir, name)
    deadline = time.monotonic() + PLAN_WAIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan {path} after {PLAN_WAIT_SECONDS} s")
        time.sleep(0.05)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    if "error" in loaded:
        raise RuntimeError(f"making the plan of {name} in the test's process failed:\n{loaded['error']}")
    return loaded["plan"]


def run_plan(plan: dict, device_mesh) -> None:
    from torch.distributed.tensor import distribute_tensor

    if "program" in plan:
        return run_program(plan, device_mesh)
    gm = passes.lower_to_dtensor(plan["gm"], device_mesh)
    inputs = [
        distribute_tensor(t, device_mesh, [p.to_dtensor() for p in placements])
        for t, placements in zip(plan["inputs"], plan["placements"])
    ]
    loss, grads = gm(*inputs)
    tolerance = plan.get("tolerance", dict(rtol=1e-4, atol=1e-5))
    torch.testing.assert_close(loss.full_tensor(), plan["loss"], **tolerance)
    assert len(grads) == len(plan["grads"]), (len(grads), len(plan["grads"]))
    for name, grad, expected in zip(plan["names"], grads, plan["grads"]):
        torch.testing.assert_close(grad.full_tensor(), expected, msg=lambda m: f"gradient of {name}: {m}", **tolerance)


def run_program(plan: dict, device_mesh) -> None:
    """A ``torch.export`` program (``torch.export.save``'s bytes) of the loss, as a user runs
    one: its module lowered, its parameters replicated DTensors (tied ones still one: loading
    unties them, so the gradient of a tied parameter is the sum over its names ``ties``), its
    inputs replicated; ``loss.backward()``; the loss and every gradient against the plain model's."""
    import io

    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    module = passes.lower_to_dtensor(torch.export.load(io.BytesIO(plan["program"])).module(), device_mesh)
    whole = [Replicate()] * device_mesh.ndim
    distributed = {}
    for owner in list(module.modules()):
        for attr, p in list(owner._parameters.items()):
            if p is not None:
                distributed.setdefault(id(p), torch.nn.Parameter(distribute_tensor(p.detach(), device_mesh, whole)))
                setattr(owner, attr, distributed[id(p)])
    loss = module(*[distribute_tensor(t, device_mesh, whole) for t in plan["inputs"]])
    loss.backward()
    tolerance = plan.get("tolerance", dict(rtol=1e-4, atol=1e-5))
    torch.testing.assert_close(loss.full_tensor(), plan["loss"], **tolerance)
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, expected in plan["grads"].items():
        tied = {id(params[n]): params[n] for n in plan["ties"][name] if n in params}  # each parameter once
        found = [p.grad for p in tied.values() if p.grad is not None]
        assert found, f"no gradient for {name}"
        grad = sum(g.full_tensor() if isinstance(g, DTensor) else g for g in found)
        torch.testing.assert_close(grad, expected, msg=lambda m: f"gradient of {name}: {m}", **tolerance)


def main(outdir: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    # A rank that failed leaves the others waiting in a collective: not for gloo's 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PLAN_WAIT_SECONDS))
    rank = dist.get_rank()
    device_mesh = rm.MESH.to_device_mesh()
    results = {}
    for name in names:
        try:
            torch.manual_seed(0)
            run_plan(load_plan(outdir, name), device_mesh)
            results[name] = None
        except Exception:  # recorded per model: the test of that model fails with it
            results[name] = traceback.format_exc()
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
