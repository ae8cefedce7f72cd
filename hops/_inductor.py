"""How the default ``torch.compile`` backend (inductor) compiles each HOP.

No HOP is ever written into a decomposition table: tracers that borrow inductor's table
(autoparallel's joint tracer, ``aot_export_joint_with_descriptors(decompositions=...)``)
keep every HOP node, as ``make_fx``, AOTAutograd and ``torch.export`` do. Inductor itself
receives the nodes in its forward and backward graphs, and a graph pass it runs before
lowering (``LowerHops``, installed as inductor's post-grad custom pass when a HOP node is
first recorded, see ``ensure_lowering_pass``) replaces each by what it computes, traced with
inductor's own decompositions. Each HOP module registers its rule here
(``register_inductor_rule``): a function that computes the HOP on the node's arguments
(bodies as GraphModules) in traceable torch code:

- an annotation: its value;
- ``named_scope``: its body, inlined (its nodes named after the scope);
- ``local_map``: its per-device program (inputs sliced, the body once per device, the
  outputs reassembled);
- ``scan``: torch's ``while_loop`` HOP, which inductor compiles as one loop whose body is
  compiled once, whatever the length;
- a kernel: its ``torch.library`` op, an opaque call; einsum: ``torch.einsum``.

A body is run by ``run_body``, which hands a HOP node met inside it to that HOP's rule, so
nested HOPs are lowered in the same trace.
"""

from __future__ import annotations

import contextlib
import operator
import re
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from hops import _compat

__all__ = ["register_inductor_rule", "inductor_rule", "run_body", "inlined", "nodes_named", "LowerHops", "lower_hops"]

# HOP -> rule(*node_args) -> the HOP's result (a tensor or a tuple)
_RULES: dict[Any, Callable[..., Any]] = {}


def register_inductor_rule(*hops: Any) -> Callable[[Callable], Callable]:
    """Register the decorated function as the inductor rule of each of ``hops``: called with
    a node's arguments, it returns what the node computes."""

    def register(rule: Callable) -> Callable:
        for hop in hops:
            _RULES[hop] = rule
        return rule

    return register


def inductor_rule(hop: Any) -> Callable[..., Any] | None:
    """``hop``'s rule, or None."""
    return _RULES.get(hop)


def is_package_hop(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator) and target.__name__.startswith("hops_")


class _RunBody(fx.Interpreter):
    """Runs a body graph op by op; a node of this package's HOPs runs its inductor rule."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if is_package_hop(target):
            return _apply_rule(target, args)
        return super().call_function(target, args, kwargs)


def run_body(body: fx.GraphModule, *inputs: Any) -> tuple:
    """``body``'s flat outputs on ``inputs``, its HOPs lowered by their rules."""
    outputs = _RunBody(body).run(*inputs)
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def inlined(body: fx.GraphModule) -> Callable[..., tuple]:
    """``body`` as a function of its inputs that ``run_body`` runs (its HOPs lowered)."""

    def call(*inputs: Any) -> tuple:
        return run_body(body, *inputs)

    call.__name__ = type(body).__name__
    return call


@contextlib.contextmanager
def nodes_named(prefix: str) -> Iterator[None]:
    """Prefix with ``prefix`` the name of every node traced inside the block (by the
    enclosing ``make_fx`` trace, if any): inductor keeps node names in its generated code's
    source-node comments and, with ``config.cpp/triton.descriptive_names = "inductor_node"``,
    in kernel names. Nested blocks stack their prefixes (``outer_inner_mul``)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    graph = None if mode is None else mode.tracer.graph
    before = set() if graph is None else set(graph.nodes)
    yield
    if graph is None:
        return
    prefix = re.sub(r"\W", "_", prefix)
    for node in graph.nodes:
        if node not in before and node.op == "call_function":
            node._rename(f"{prefix}_{node.name}")


def _apply_rule(hop: Any, args: Any) -> Any:
    rule = inductor_rule(hop)
    if rule is None:
        raise NotImplementedError(f"{hop.__name__}: no inductor rule (hops._inductor.register_inductor_rule)")
    return rule(*args)


# --------------------------------------------------------------------------- the pass


def _replace_node(node: fx.Node) -> None:
    """Replace the HOP ``node`` by its rule, traced with inductor's decompositions on the
    node's example values (``meta["val"]``, which inductor keeps on every node)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    owner = node.graph.owning_module
    leaves, treespec = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [leaf for leaf in leaves if isinstance(leaf, fx.Node) and leaf.op != "get_attr"]
    examples = [leaf.meta["val"] for leaf in inputs]

    def replacement(*values: Any) -> Any:
        given = iter(values)
        resolved = [
            (getattr(owner, str(leaf.target)) if leaf.op == "get_attr" else next(given)) if isinstance(leaf, fx.Node) else leaf
            for leaf in leaves
        ]
        args, kwargs = pytree.tree_unflatten(resolved, treespec)
        return _apply_rule(node.target, args)

    fake_mode = detect_fake_mode([e for e in examples if isinstance(e, torch.Tensor)])
    with _compat.inductor_tracing(fake_mode):
        traced = make_fx(replacement, _compat.inductor_decompositions(), tracing_mode="real")(*examples)
    _splice(node, traced, inputs)


def _splice(node: fx.Node, traced: fx.GraphModule, inputs: list[fx.Node]) -> None:
    """Put ``traced``'s nodes where ``node`` is, fed ``inputs``, and route ``node``'s uses
    to its outputs. What ``traced`` holds as attributes (subgraphs, tensor constants) moves
    to the owning module under fresh names."""
    graph, owner = node.graph, node.graph.owning_module
    placeholders = traced.graph.find_nodes(op="placeholder")
    before = set(graph.nodes)
    with graph.inserting_before(node):
        outputs = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    for copied in graph.nodes:
        if copied.op == "get_attr" and copied not in before:
            value = getattr(traced, str(copied.target))
            fresh, suffix = str(copied.target), 0
            while hasattr(owner, fresh):
                suffix += 1
                fresh = f"{copied.target}_{suffix}"
            if isinstance(value, torch.nn.Module):
                owner.register_module(fresh, value)
            else:
                setattr(owner, fresh, value)
            copied.target = fresh
    if isinstance(outputs, (tuple, list)):
        outputs = list(outputs)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
        if node.users:  # the tuple itself is used (an output of the graph)
            raise RuntimeError(f"{node.format_node()}: its tuple result is used whole: {list(node.users)}")
    else:
        node.replace_all_uses_with(outputs)
    graph.erase_node(node)  # its bodies' get_attr nodes, now unused, go with lower_hops' dead-code pass


def lower_hops(graph: fx.Graph) -> bool:
    """Replace every node of this package's HOPs in ``graph`` by its inductor rule; whether
    any was replaced."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and is_package_hop(n.target)]
    for node in nodes:
        _replace_node(node)
    if nodes:
        # A scan's rule leaves a while_loop, whose body inductor lowers as a subgraph.
        _compat.undonated_subgraph_inputs()
        graph.eliminate_dead_code()
        graph.lint()
        owner = graph.owning_module
        if owner is not None:
            used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
            for name, child in list(owner.named_children()):
                if isinstance(child, fx.GraphModule) and name not in used:
                    delattr(owner, name)
            owner.recompile()
    return bool(nodes)


LowerHops = _compat.inductor_graph_pass(lower_hops)


def ensure_lowering_pass() -> None:
    """Make inductor lower the HOP nodes of the graphs it compiles (``LowerHops``, chained
    with the user's post-grad pass: see ``_compat.install_inductor_pass``). Called where a
    HOP node is recorded, not at import: importing ``hops`` writes no torch setting."""
    _compat.install_inductor_pass(LowerHops)
