"""``format_placements``: the program printed with its solved placements, for solver authors."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.named_scope import named_scope_hop
from hops.scan import scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, ShardingSpec
from passes._infra import hop_row, hop_table, is_package_hop, ordinary_op
from passes.solver._dtensor import rule_of
from passes.solver.graph import NodeKind, as_program, format_placement
from passes.solver.solve import PlacementSolution, node_costs

__all__ = ["format_placements"]


def _target(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
        return f"aten.{name}" if target.namespace == "aten" else f"{target.namespace}.{name}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", None) or getattr(target, "_name", str(target))


def _arg(value: Any) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, ShardingSpec):
        return f"ShardingSpec({format_placement(value.placements)})"
    if isinstance(value, LocalMapSpec):
        return "LocalMapSpec(...)"
    return repr(value)


def _microseconds(seconds: float) -> str:
    return f"{seconds * 1e6:.3g}us"


class _Printer:
    def __init__(self, solution: PlacementSolution) -> None:
        self.solution = solution
        self.graph = solution.graph
        self.costs = node_costs(solution)
        self.lines: list[str] = []

    def key(self, node: fx.Node, scope: str) -> str:
        return f"{scope}{node.name}"

    def module(self, module: fx.GraphModule, scope: str, indent: str) -> None:
        for node in module.graph.nodes:
            if node.op == "output":
                self.lines.append(f"{indent}return {_arg(node.args[0])}")
                continue
            key = self.key(node, scope)
            text = self._call_text(node)
            self.lines.append(f"{indent}{node.name} = {text}{self._comment(key)}")
            if node.op == "call_function" and is_package_hop(node.target):
                body_text = hop_row(FORMAT_PLACEMENTS, node.target, "format_placements", node)
                if body_text is not ordinary_op:
                    body_text(self, node, module, scope, indent)

    def _region_body(self, node: fx.Node, module: fx.GraphModule, scope: str, indent: str) -> None:
        body = node.args[0]
        if isinstance(body, (tuple, list)):
            # One body per alternative, each on its own local shapes.
            for index, attr in enumerate(body):
                submodule = module.get_submodule(str(attr.target))
                count = sum(1 for n in submodule.graph.nodes if n.op == "call_function")
                self.lines.append(
                    f"{indent}  # body {attr.target} (alternative {index}): {count} ops on each device's local shards"
                )
        elif _is_body(body):
            submodule = module.get_submodule(str(body.target))
            count = sum(1 for n in submodule.graph.nodes if n.op == "call_function")
            self.lines.append(f"{indent}  # body {body.target}: {count} ops on each device's local shards")

    def _scan_body(self, node: fx.Node, module: fx.GraphModule, scope: str, indent: str) -> None:
        body = node.args[0]
        if not _is_body(body):
            return
        body_scope = f"{scope}{body.target}/"
        scan = next(s for s in self.graph.graph.get("scans", []) if s["node"] is node)
        total = self._scope_seconds(body_scope)
        self.lines.append(
            f"{indent}  # body {body.target}, once for {scan['length']} steps "
            f"(placements hold at every step; {_microseconds(total)} per step):"
        )
        self.module(module.get_submodule(str(body.target)), body_scope, indent + "    ")

    def _scope_body(self, node: fx.Node, module: fx.GraphModule, scope: str, indent: str) -> None:
        body = node.args[0]
        if not _is_body(body):
            return
        self.lines.append(f"{indent}  # body {body.target}:")
        self.module(module.get_submodule(str(body.target)), f"{scope}{body.target}/", indent + "    ")

    def _scope_seconds(self, scope: str) -> float:
        return sum(
            sum(self.costs[k]) for k in self.costs if k.startswith(scope) and self.graph.nodes[k]["kind"] is not NodeKind.LOCAL
        )

    def _call_text(self, node: fx.Node) -> str:
        if node.op == "placeholder":
            return "input()"
        if node.op == "get_attr":
            return f"self.{node.target}"
        args = ", ".join([*(_arg(a) for a in node.args), *(f"{k}={_arg(v)}" for k, v in node.kwargs.items())])
        return f"{_target(node)}({args})"

    def _comment(self, key: str) -> str:
        if key not in self.graph.nodes:
            return ""
        data = self.graph.nodes[key]
        if data["kind"] is NodeKind.LOCAL:
            return "  # per device"
        strategy = self.solution.strategies.get(key)
        parts = []
        if strategy is not None:
            inputs = ", ".join(format_placement(p) for p in strategy.inputs)
            outputs = ", ".join(format_placement(p) for p in strategy.outputs)
            if len(strategy.inputs) == 0:
                parts.append(f"placement={outputs}")
            else:
                parts.append(f"placement=({inputs}) -> {outputs}")
            if data["kind"] is NodeKind.REGION:
                count = len(data["strategies"])
                parts.append(f"alternative {data['strategies'].index(strategy)} of {count}")
            if data["fallback"]:
                parts.append(_fallback(data["fx_node"].target))
            compute, communication = self.costs[key]
            if compute or communication:
                parts.append(f"cost=[compute {_microseconds(compute)}, redistribute {_microseconds(communication)}]")
        elif key in self.solution.placements:
            parts.append(f"placement={format_placement(self.solution.placements[key])}")
        return ("  # " + ", ".join(parts)) if parts else ""


def _fallback(target: Any) -> str:
    """How a value the solver places replicated for want of a DTensor rule is computed."""
    if isinstance(target, torch._ops.OpOverload):
        if rule_of(target) is None:  # what passes.lower_to_dtensor runs with run_replicated
            return "no DTensor rule: run replicated (inputs gathered, the op on local tensors)"
        return "DTensor's rule places none of these inputs' layouts: replicated"
    return "no DTensor rule: replicated"


def _is_body(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "get_attr"


# What ``format_placements`` prints under each HOP's line: a method of ``_Printer`` (a scan's
# body once with its trip count, a named scope's body, a region's body size per alternative),
# or ``ordinary_op``: nothing more than the line (an annotation, a kernel).
FORMAT_PLACEMENTS = "format_placements"
hop_table(FORMAT_PLACEMENTS).update(
    {
        local_map_hop: _Printer._region_body,
        scan_hop: _Printer._scan_body,
        named_scope_hop: _Printer._scope_body,
        sharding_annotation_hop: ordinary_op,
        Kernel: ordinary_op,
    }
)


def format_placements(gm: Any, solution: PlacementSolution) -> str:
    """``gm`` (a GraphModule or ``(forward, backward)``) printed node by node, each with its
    placement (``(inputs) -> output``, one token per mesh axis: ``S(d)``, ``R``, ``P``) and its
    cost; a scan body printed once with its trip count, a region with its chosen alternative."""
    program = as_program(gm, "format_placements")
    printer = _Printer(solution)
    mesh = solution.mesh
    printer.lines.append(
        f"# mesh {dict(zip(mesh.axis_names, mesh.shape))}, cost {_microseconds(solution.cost)} per step "
        f"(cost model {solution.cost_model.name}), peak {solution.memory / 2**20:.4g} MiB per device"
    )
    for scope, module in program:
        if scope:
            printer.lines.append(f"{scope.rstrip('/')}:")
        printer.module(module, scope, "  " if scope else "")
    return "\n".join(printer.lines) + "\n"
