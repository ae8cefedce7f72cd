"""What every pass of this package shares: a rule table applied over a graph and its subgraphs.

A pass here is a ``torch.fx.passes.infra.pass_base.PassBase``: ``requires`` checks its input,
``call`` rewrites, ``ensures`` checks what it promised. ``HopRulePass`` is the common shape:
one rule per HOP, applied to every ``call_function`` node of that HOP in the root graph and in
every nested ``GraphModule`` (HOP bodies), each visited once. Rules read only node args
(never ``node.meta``), so deleting meta cannot change the result. Every changed graph is
linted, loses submodules nothing refers to any more, and is recompiled; the walk is linear
in the number of nodes.
"""

from __future__ import annotations

import operator
from typing import Callable, Iterator

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

Rule = Callable[[fx.Node], None]


def graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and every ``GraphModule`` nested in it (HOP bodies), each once."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield module


def _drop_unreferenced_subgraphs(module: fx.GraphModule) -> None:
    """Delete child GraphModules no node of ``module`` refers to any more.

    Not ``delete_all_unused_submodules``: it treats a ``get_attr`` as using only that path,
    and would delete the bodies nested inside a still-referenced body.
    """
    used = {
        str(node.target).split(".")[0]
        for node in module.graph.nodes
        if node.op in ("get_attr", "call_module")
    }
    for name, child in list(module.named_children()):
        if isinstance(child, fx.GraphModule) and name not in used:
            delattr(module, name)


class PassError(ValueError):
    """A graph a pass cannot handle; the message names the node."""


def body_module(node: fx.Node) -> fx.GraphModule:
    """The subgraph a HOP node takes as its first argument (a ``get_attr``)."""
    body = node.args[0]
    if not (isinstance(body, fx.Node) and body.op == "get_attr"):
        raise PassError(f"{node.format_node()}: expected a get_attr of the body subgraph as first argument")
    return node.graph.owning_module.get_submodule(body.target)


def copy_body_into(node: fx.Node, body: fx.GraphModule, inputs: list) -> list:
    """Copy ``body``'s nodes before ``node``, fed ``inputs``; return its outputs (a list).

    Subgraphs the body refers to (bodies of HOPs inside it) move along under fresh names
    of the module that owns ``node``.
    """
    graph = node.graph
    owner = graph.owning_module
    with graph.inserting_before(node):
        outputs = graph.graph_copy(body.graph, dict(zip(body.graph.find_nodes(op="placeholder"), inputs)))
    renamed: dict[str, str] = {}
    for copied in list(graph.nodes):
        if copied.op == "get_attr" and not hasattr(owner, str(copied.target)) and hasattr(body, str(copied.target)):
            target = str(copied.target)
            if target not in renamed:
                fresh = target
                suffix = 0
                while hasattr(owner, fresh):
                    suffix += 1
                    fresh = f"{target}_{suffix}"
                owner.register_module(fresh, getattr(body, target))
                renamed[target] = fresh
            copied.target = renamed[target]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def replace_tuple_output(node: fx.Node, values: list[fx.Node]) -> None:
    """Make every ``node[i]`` read ``values[i]``, then erase ``node`` and its unused body ``get_attr``."""
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            raise PassError(f"{node.format_node()}: its tuple output is used by {user.format_node()}, not by getitem")
        user.replace_all_uses_with(values[user.args[1]])
        node.graph.erase_node(user)
    body = node.args[0]
    node.graph.erase_node(node)
    if isinstance(body, fx.Node) and body.op == "get_attr" and not body.users:
        node.graph.erase_node(body)


class HopRulePass(PassBase):
    """Apply ``rules[node.target](node)`` to every node whose target has a rule."""

    def __init__(self, name: str, rules: dict[object, Rule]) -> None:
        super().__init__()
        self.name = name
        self.rules = rules

    def requires(self, graph_module: fx.GraphModule) -> None:
        if not isinstance(graph_module, fx.GraphModule):
            raise TypeError(
                f"{self.name} expects a torch.fx.GraphModule, got {type(graph_module).__name__}"
            )

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        modified = False
        for module in list(graph_modules(graph_module)):
            graph_changed = False
            for node in list(module.graph.nodes):
                if node.op == "call_function":
                    rule = self.rules.get(node.target)
                    if rule is not None:
                        rule(node)
                        graph_changed = True
            if graph_changed:
                module.graph.lint()
                _drop_unreferenced_subgraphs(module)  # e.g. bodies of inlined regions
                module.recompile()
                modified = True
        return PassResult(graph_module, modified)

    def ensures(self, graph_module: fx.GraphModule) -> None:
        for module in graph_modules(graph_module):
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target in self.rules:
                    raise AssertionError(f"{self.name} left {node.format_node()}")
