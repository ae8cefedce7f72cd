"""The shape and dtype of every value of a traced program, HOP bodies included.

Every tracer records a value's metadata as ``node.meta["val"]``, the one piece of meta the
solver reads. Where any of it is missing (meta deleted, a graph built by hand), the whole
program is run again on fake tensors made from ``example_inputs``: a HOP's body is run on
what it sees (a scan step's slices, a region's local shards) and the HOP's results are made
from the body's, so every value inside a body gets its metadata too. Nothing is written
into ``node.meta``.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from hops import lowering as _layout  # its layout functions
from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.named_scope import named_scope_hop
from hops.scan import scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from passes._infra import PassError, hop_row, hop_table, is_package_hop, ordinary_op

ValueMeta = dict  # fx.Node -> fake tensor, tuple of them, or a Python value


def _needs_value(node: fx.Node) -> bool:
    if node.op == "output":
        return False
    if node.op == "get_attr":
        owner = node.graph.owning_module
        return not isinstance(getattr(owner, str(node.target), None), torch.nn.Module)
    return True


def recorded_metadata(modules: Sequence[fx.GraphModule]) -> ValueMeta | None:
    """``node.meta["val"]`` of every node of ``modules`` and their bodies, or ``None`` if any is missing."""
    values: ValueMeta = {}
    for root in modules:
        for module in root.modules():
            if not isinstance(module, fx.GraphModule):
                continue
            for node in module.graph.nodes:
                if not _needs_value(node):
                    continue
                if "val" not in node.meta:
                    return None
                values[node] = node.meta["val"]
    return values


class _FakeRun(fx.Interpreter):
    """Runs a graph on fake tensors, recording every node's result; HOP bodies run inside."""

    def __init__(self, module: fx.GraphModule, values: ValueMeta) -> None:
        super().__init__(module, garbage_collect_values=False)
        self.values = values

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        if _needs_value(node):
            self.values[node] = result
        return result

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if is_package_hop(target):
            shapes = hop_row(SOLVER_SHAPES, target, "solver shapes")
            if shapes is not ordinary_op:
                return shapes(self, args)
        return super().call_function(target, args, kwargs)

    def _named_scope(self, args: Sequence[Any]) -> tuple:
        body, *inputs, _ = args
        return tuple(_run(body, inputs, self.values))

    def _scan(self, args: Sequence[Any]) -> tuple:
        body, *inputs, spec = args
        carry = inputs[: spec.num_carry]
        xs = inputs[spec.num_carry : spec.num_carry + spec.num_xs]
        additional = inputs[spec.num_carry + spec.num_xs :]
        length = xs[0].shape[0] if xs else spec.length
        outputs = _run(body, [*carry, *(x.new_empty(x.shape[1:]) for x in xs), *additional], self.values)
        ys = [y.new_empty((length, *y.shape)) for y in outputs[spec.num_carry :]]
        return (*(c.new_empty(c.shape) for c in outputs[: spec.num_carry]), *ys)

    def _local_map(self, args: Sequence[Any]) -> tuple:
        body, *inputs, spec = args
        # A region with alternatives has one body per alternative: each runs on its own
        # local shapes (every value inside each gets its metadata); the active one's outputs
        # make the region's.
        bodies = list(body) if isinstance(body, (tuple, list)) else [body]
        options = spec.options() if len(bodies) > 1 else (spec,)
        results = []
        for option, module in zip(options, bodies):
            local = [
                value if placements is None
                else value.new_empty(_layout.local_shape(value.shape, placements, spec.mesh, f"local_map input {i}"))
                for i, (value, placements) in enumerate(zip(inputs, option.in_placements))
            ]
            outputs = _run(module, local, self.values)
            results.append(
                tuple(
                    out.new_empty(_layout.global_shape(out.shape, placements, spec.mesh, f"local_map output {j}"))
                    for j, (out, placements) in enumerate(zip(outputs, option.out_placements))
                )
            )
        return results[(spec.active or 0) if len(bodies) > 1 else 0]


# How each HOP's results are made on fake tensors: a method of ``_FakeRun`` running its
# body on what the body sees, or ``ordinary_op``: the HOP runs on fake tensors as it is (an
# annotation, a kernel's abstract implementation).
SOLVER_SHAPES = "solver shapes"
hop_table(SOLVER_SHAPES).update(
    {
        scan_hop: _FakeRun._scan,
        local_map_hop: _FakeRun._local_map,
        named_scope_hop: _FakeRun._named_scope,
        sharding_annotation_hop: ordinary_op,
        Kernel: ordinary_op,
    }
)


def _run(module: fx.GraphModule, inputs: Sequence[Any], values: ValueMeta) -> list:
    outputs = _FakeRun(module, values).run(*inputs)
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def recompute_metadata(
    modules: Sequence[fx.GraphModule], example_inputs: Sequence[Any] | None, where: str
) -> ValueMeta:
    """Run ``modules`` (one program, or a forward and its backward) on fake tensors.

    The backward's inputs are the forward's saved outputs (its last outputs, one per
    non-tangent placeholder) followed by one tangent per differentiable forward output.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    forward = modules[0]
    placeholders = forward.graph.find_nodes(op="placeholder")
    if example_inputs is None:
        if not all("val" in p.meta for p in placeholders):
            missing = next(p.name for p in placeholders if "val" not in p.meta)
            raise PassError(
                f"{where}: the graph's metadata was deleted (placeholder {missing} has no "
                "node.meta['val']), so shapes must be recomputed: pass example_inputs= with the "
                "program's inputs (real or fake tensors)"
            )
        example_inputs = [p.meta["val"] for p in placeholders]
    if len(example_inputs) != len(placeholders):
        raise PassError(
            f"{where}: example_inputs has {len(example_inputs)} values but the graph has "
            f"{len(placeholders)} placeholders"
        )
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: ValueMeta = {}
    with mode:
        fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in example_inputs]
        outputs = _run(forward, fakes, values)
        for backward in modules[1:]:
            saved, tangents = split_backward_inputs(backward)
            if len(saved) > len(outputs):
                raise PassError(f"{where}: the backward reads {len(saved)} saved values, the forward returns {len(outputs)}")
            inputs = {p: v for p, v in zip(saved, outputs[len(outputs) - len(saved) :])}
            inputs.update({p: v for p, v in zip(tangents, outputs)})
            _run(backward, [inputs[p] for p in backward.graph.find_nodes(op="placeholder")], values)
    return values


def split_backward_inputs(backward: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """A backward graph's placeholders: the saved values, then the tangents (AOTAutograd
    names them ``tangents_<i>``)."""
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    tangents = [p for p in placeholders if p.name.startswith("tangents")]
    saved = [p for p in placeholders if not p.name.startswith("tangents")]
    return saved, tangents


def value_metadata(
    modules: Sequence[fx.GraphModule], example_inputs: Sequence[Any] | None, where: str
) -> ValueMeta:
    recorded = recorded_metadata(modules)
    if recorded is not None:
        return recorded
    return recompute_metadata(modules, example_inputs, where)


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def getitem_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0], node.args[1]
    return None
