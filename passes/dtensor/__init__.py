"""The DTensor target: ``lower_to_dtensor(gm, device_mesh)`` (rules in ``rules.py``, what the
lowered graph calls in ``runtime.py``).

The lowered graph takes and returns DTensors on ``device_mesh`` and runs on real processes
(``torchrun --nproc-per-node 4`` with gloo on CPU; NCCL at scale): every collective is a
redistribution the placements in the graph state, issued by DTensor.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from hops.named_scope import named_scope_hop
from hops.specs import Mesh
from passes._infra import HopRulePass
from passes.dtensor import rules

__all__ = ["lower_to_dtensor", "collective_counts"]


class _DTensorPass(HopRulePass):
    """``HopRulePass`` that first finds which graphs run on local tensors (region bodies)."""

    def __init__(self, mesh: Mesh, device_mesh: Any, *, record_scopes: bool) -> None:
        overrides = {named_scope_hop: rules.profile_named_scope} if record_scopes else None
        super().__init__(rules.TARGET, name="lower_to_dtensor", rules=overrides)
        # Without names on the DeviceMesh, specs' axis names are not compared.
        self.state = {"mesh": mesh, "device_mesh": device_mesh, "named": device_mesh.mesh_dim_names is not None, "local": set()}

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        self.state["local"] = rules.local_bodies(graph_module)
        # Before the HOPs: region bodies are still their own graphs (their ops see local tensors).
        replicated = rules.run_ops_without_rules_replicated(graph_module, self.state["local"])
        rules.register_device_mesh(self.state["mesh"], self.state["device_mesh"])
        plain = rules.replicate_plain_tensors(graph_module, self.state["local"], self.state["mesh"])
        token = rules._LOWERING.set(self.state)
        try:
            result = super().call(graph_module)
        finally:
            rules._LOWERING.reset(token)
        return PassResult(result.graph_module, result.modified or replicated or plain)

    def ensures(self, graph_module: fx.GraphModule) -> None:
        token = rules._LOWERING.set(self.state)
        try:
            super().ensures(graph_module)
        finally:
            rules._LOWERING.reset(token)


def _device_mesh(device_mesh: Any) -> Any:
    """A DTensor ``DeviceMesh`` from the argument (a ``hops.Mesh`` needs a live process group)."""
    if isinstance(device_mesh, Mesh):
        try:
            return device_mesh.to_device_mesh()
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"lower_to_dtensor(device_mesh={device_mesh!r}): {error}") from None
    if hasattr(device_mesh, "mesh") and hasattr(device_mesh, "mesh_dim_names") and hasattr(device_mesh, "get_coordinate"):
        return device_mesh
    raise TypeError(
        f"lower_to_dtensor(device_mesh=...) must be a torch.distributed DeviceMesh or a hops.Mesh, "
        f"got {type(device_mesh).__name__} {device_mesh!r}"
    )


def lower_to_dtensor(gm: fx.GraphModule, device_mesh: Any, *, record_scopes: bool = False) -> fx.GraphModule:
    """Lower every HOP of this package in ``gm`` and its subgraphs to DTensor (in place); return ``gm``.

    ``device_mesh``: a DTensor ``DeviceMesh`` or a ``hops.Mesh`` (converted on the initialized
    process group). Every spec's mesh must have its shape, axis names and ranks; the lowered
    graph takes and returns DTensors on it (plain tensors inside ``local_map`` bodies).
    An ATen op DTensor has no sharding strategy for (``stats["unsupported_ops"]`` of a
    solution, e.g. SDPA on CPU forward and backward) runs as the solver prices it: its inputs
    gathered to ``Replicate``, the op on local tensors, its outputs replicated DTensors. A tensor
    constant or a factory op's result outside region bodies becomes a replicated DTensor.
    ``record_scopes``: run named scopes under ``torch.profiler.record_function`` instead of
    inlining them. Raises ``PassError`` naming the node for a mesh mismatch, a kernel outside
    a region, a region inside a region, or an in-place op DTensor has no strategy for.
    """
    device_mesh = _device_mesh(device_mesh)
    mesh = Mesh.from_device_mesh(device_mesh)
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"lower_to_dtensor(device_mesh=...): this rank is not in {device_mesh!r}")
    _DTensorPass(mesh, device_mesh, record_scopes=record_scopes)(gm)
    return gm


def collective_counts(comm_mode: Any) -> dict[str, int]:
    """What a ``torch.distributed.tensor.debug.CommDebugMode`` counted, by kind as
    ``PlacementSolution.collectives()`` names them (``"all_gather"``, ``"all_reduce"``,
    ``"reduce_scatter"``, ``"all_to_all"``); any other collective under its op's name."""
    counts: dict[str, int] = {}
    for op, count in comm_mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        # Functional ops (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, DTensor's
        # shard_dim_alltoall) and c10d's (allgather_, allreduce_, ...) spell the kinds differently.
        flat = name.replace("_", "")
        kind = next(
            (k for k in ("all_gather", "all_reduce", "reduce_scatter") if flat.startswith(k.replace("_", ""))),
            "all_to_all" if "alltoall" in flat else name,
        )
        counts[kind] = counts.get(kind, 0) + count
    return counts
