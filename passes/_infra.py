"""What every pass of this package shares: one registry of rules, per target and per HOP.

A lowering *target* (``"inline"``, ``"xla"``, ``"unroll"``, ...) is a table of rules, one per
HOP, as JAX registers one lowering per primitive per platform. A target module registers
its rules with ``@register_rule(target, hop)`` (a rule for a HOP class, e.g. ``Kernel``,
serves every instance without its own rule); a HOP a target leaves as it is gets ``keep``,
one a target cannot take gets ``refuse(why)``. Adding a HOP is adding its rules to each
target; adding a target is adding a table (``CONTRIBUTING.md``).

``HopRulePass(target)`` applies a target's table to every node of this package's HOPs in a
graph and in every subgraph (HOP bodies), bodies before the graphs that hold them, so what
a rule copies up from a body is already rewritten. A HOP without a rule is a ``PassError``
naming the node and the target, never a node silently left in a "lowered" graph. Rules
read only node args (never ``node.meta``), so deleting meta cannot change a result. Every
changed graph is linted, loses submodules nothing refers to any more, and is recompiled;
the walk is linear in the number of nodes.

A pass rewrites the graph it is given in place, and only that graph: the bodies nested in
it are first made its own copies (``own_subgraphs``), as they may be shared with what it
was made from (``ExportedProgram.module()`` hands out the program's own bodies). A node a
rule makes gets the ``meta["val"]`` its op computes on its inputs' values (``fill_vals``)
in a graph whose values are fake tensors, as every traced graph's are, so the graph stays
one that tools reading values (``torch.export``'s verifier, the solver) accept.

The targets are not the only per-HOP tables: the solver's view of a HOP (``placement_graph``:
what it fixes, its body's scope; the shapes of its results), ``check_placements``' rule and
``format_placements``' rule are tables of the same shape, made with ``hop_table(name)``;
hops/_inductor.py holds the inductor lowering (``hops.lowering.inductor_rule``).
``hop_tables()`` finds every one of them (a test checks that every HOP has a row in each). A HOP a table need not treat specially gets the
explicit row ``ordinary_op``, so a missing row always means a forgotten one.
"""

from __future__ import annotations

import copy
import importlib
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.infra.pass_base import PassBase, PassResult

Rule = Callable[[fx.Node], None]

# target -> {HOP (or HOP class) -> rule}
RULES: dict[str, dict[Any, Rule]] = {}


class PassError(ValueError):
    """A graph a pass cannot handle; the message names the node (and the target)."""


def register_rule(target: str, *hops: Any) -> Callable[[Rule], Rule]:
    """Register the decorated function as ``target``'s rule for each of ``hops``."""

    def register(rule: Rule) -> Rule:
        table = RULES.setdefault(target, {})
        for hop in hops:
            table[hop] = rule
        return rule

    return register


# name -> {HOP (or HOP class) -> row}: every per-HOP table besides the targets' (``hop_table``)
HOP_TABLES: dict[str, dict[Any, Any]] = {}

# The modules whose import registers a per-HOP table (targets included): ``hop_tables`` imports them.
TABLE_MODULES = (
    "passes.inline",
    "passes.xla",
    "passes.dtensor",
    "passes.unroll",
    "passes.jax",
    "passes.check",
    "passes.solver",
)


def hop_table(name: str) -> dict[Any, Any]:
    """The per-HOP table ``name`` (created empty and registered on first use): its module fills it
    with one row per HOP (or HOP class, serving every instance), ``ordinary_op`` where the HOP
    is an ordinary op for it."""
    return HOP_TABLES.setdefault(name, {})


def ordinary_op(*args: Any) -> None:
    """The row of a table that treats the HOP as any other op (e.g. a kernel in the solver's view)."""


def table_row(table: dict[Any, Any], hop: Any) -> Any:
    """``hop``'s row in ``table``: its own, else its class's, else None."""
    row = table.get(hop)
    if row is None:
        row = next((table[cls] for cls in type(hop).__mro__ if cls in table), None)
    return row


def hop_row(name: str, hop: Any, where: str, node: fx.Node | None = None) -> Any:
    """``hop``'s row in the table ``name``, or ``PassError`` (naming ``where`` and the node): a
    HOP without a row was forgotten, never silently treated as an ordinary op."""
    row = table_row(HOP_TABLES.get(name, {}), hop)
    if row is None:
        what = node.format_node() if node is not None else hop.__name__
        raise PassError(
            f"{where}: no {name!r} row for {what} ({hop.__name__}); add one to its table (passes._infra.hop_table({name!r}))"
        )
    return row


def hop_tables() -> dict[str, Callable[[Any], Any]]:
    """Every per-HOP table, by name, as a lookup ``hop -> row or None``: each target (``"target
    'xla'"``), each ``hop_table``, and the inductor lowering (``"inductor"``)."""
    for module in TABLE_MODULES:
        importlib.import_module(module)
    from hops.lowering import inductor_rule

    tables: dict[str, Callable[[Any], Any]] = {
        f"target {target!r}": (lambda hop, target=target: rule_for(target, hop)) for target in RULES
    }
    tables.update({name: (lambda hop, table=table: table_row(table, hop)) for name, table in HOP_TABLES.items()})
    tables["inductor"] = inductor_rule
    return tables


def missing_rows(hops: Any) -> list[tuple[str, str]]:
    """``(table, HOP name)`` for every HOP of ``hops`` that has no row in a table of ``hop_tables()``."""
    tables = hop_tables()
    return [(name, hop.__name__) for name, lookup in tables.items() for hop in hops if lookup(hop) is None]


def keep(node: fx.Node) -> None:
    """The rule of a target that leaves this HOP as it is (its bodies are still visited)."""


def refuse(why: str) -> Rule:
    """A rule that refuses the HOP with ``PassError`` saying ``why``."""

    def refuse_node(node: fx.Node) -> None:
        raise PassError(f"{node.format_node()}: {why}")

    refuse_node.reason = why
    return refuse_node


def rule_for(target: str, hop: Any) -> Rule | None:
    """``target``'s rule for ``hop``: its own, else its class's, else None."""
    return table_row(RULES.get(target, {}), hop)


def is_package_hop(target: Any) -> bool:
    """Whether ``target`` is one of this package's HOPs (registered with the ``hops_`` prefix)."""
    return isinstance(target, torch._ops.HigherOrderOperator) and target.__name__.startswith("hops_")


def graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and every ``GraphModule`` nested in it (HOP bodies), each once, parents first."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield module


def bodies_first(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and its nested GraphModules, each after every GraphModule nested in it."""
    return list(reversed(list(graph_modules(gm))))


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


def own_subgraphs(gm: fx.GraphModule) -> None:
    """Replace every GraphModule nested in ``gm`` (HOP bodies, at any depth) by a copy of its
    own, so a pass rewriting bodies in place changes ``gm`` and nothing else.

    ``torch.export.ExportedProgram.module()`` (torch 2.9 .. 2.15) copies the top graph but
    shares the program's body modules: a pass run on it rewrote the exported program's bodies
    too (which then no longer ran as exported, and which ``torch.export.save`` refused: a
    node the rewrite made had no ``meta["val"]``). Copies keep node names and meta (shallow);
    a body two graphs of ``gm`` share stays shared between their copies."""
    copies: dict[int, fx.GraphModule] = {}

    def own(module: fx.GraphModule) -> None:
        for name, child in list(module.named_children()):
            if not isinstance(child, fx.GraphModule):
                continue
            if id(child) not in copies:
                graph = copy.deepcopy(child.graph)  # nodes copied with their names and meta
                # Not torch's lazily compiled module: its ``forward`` calls the module
                # (hooks and all), where a target's runner calls a body's ``forward``.
                duplicate = fx.GraphModule(child, graph, class_name=type(child).__name__)
                duplicate.meta.update(getattr(child, "meta", {}))
                copies[id(child)] = duplicate
                own(duplicate)
            setattr(module, name, copies[id(child)])

    own(gm)


def _fake_mode_of(graph: fx.Graph) -> Any:
    for node in graph.nodes:
        for value in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, FakeTensor):
                return value.fake_mode
    return None


class _Unknown:
    """An input whose value is not known (a node without ``meta["val"]``)."""


def _valued_target(target: Any, args: Any) -> bool:
    """Whether ``fill_vals`` may compute a node of ``target``: an op, ``getitem``, or a HOP
    without bodies (a kernel, an annotation); never a Python function (a runner)."""
    if isinstance(target, torch._ops.OpOverload) or target is operator.getitem:
        return True
    return isinstance(target, torch._ops.HigherOrderOperator) and not any(
        isinstance(a, fx.Node) and a.op == "get_attr" for a in torch.utils._pytree.tree_leaves(args)
    )


def fill_vals(graph: fx.Graph) -> None:
    """Give every node of ``graph`` that lacks ``meta["val"]`` (one a rule made) the value its
    target computes on its inputs' values, under their fake mode. A graph without fake values
    (built by hand, traced on real tensors) is left as it is, and so is a node whose inputs'
    values are not all known, whose target is a Python function (run only on real values), or
    that its op cannot compute on fake tensors (an op of a device library without a fake
    kernel, say): nothing reads a missing value as more than unknown."""
    missing = [n for n in graph.nodes if n.op == "call_function" and "val" not in n.meta]
    if not missing:
        return
    fake_mode = _fake_mode_of(graph)
    if fake_mode is None:
        return
    for node in missing:
        if not _valued_target(node.target, node.args):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val", _Unknown))
        if any(v is _Unknown for v in torch.utils._pytree.tree_leaves((args, kwargs))):
            continue
        try:
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op without a fake kernel: its value stays unknown
            continue


def body_attrs(node: fx.Node) -> list[fx.Node]:
    """The ``get_attr`` nodes of a HOP node's bodies: its first argument, or the tuple of
    them of a HOP whose spec offers options (one body per option, ``local_map``'s
    alternatives), checked to be one per option."""
    body = node.args[0] if node.args else None
    bodies = list(body) if isinstance(body, (tuple, list)) else [body]
    if not bodies or not all(isinstance(b, fx.Node) and b.op == "get_attr" for b in bodies):
        raise PassError(f"{node.format_node()}: expected a get_attr of the body subgraph (or a tuple of them) as first argument")
    options = node.target.num_options(node.args[-1]) if hasattr(node.target, "num_options") else 1
    if isinstance(body, (tuple, list)) != (options > 1) or len(bodies) != options:
        raise PassError(f"{node.format_node()}: {len(bodies)} bodies for a spec with {options} options; expected one per option")
    return bodies


def _module_of(node: fx.Node, attr: fx.Node) -> fx.GraphModule:
    module = node.graph.owning_module.get_submodule(attr.target)
    if not isinstance(module, fx.GraphModule):
        raise PassError(f"{node.format_node()}: its body {attr.target} is a {type(module).__name__}, not a GraphModule")
    return module


def body_attr(node: fx.Node) -> fx.Node:
    """The ``get_attr`` of the body the node runs: its one body, or its spec's active option's."""
    bodies = body_attrs(node)
    return bodies[node.target.active_option(node.args[-1])] if len(bodies) > 1 else bodies[0]


def body_module(node: fx.Node) -> fx.GraphModule:
    """The subgraph a HOP node runs (its first argument, a ``get_attr``; of a tuple of them,
    one per option, the active option's): what a lowering makes of the node."""
    return _module_of(node, body_attr(node))


def body_modules(node: fx.Node) -> list[fx.GraphModule]:
    """Every body of a HOP node (one, or one per option)."""
    return [_module_of(node, attr) for attr in body_attrs(node)]


def check_spec(node: fx.Node, target: str) -> None:
    """``PassError`` naming ``node`` unless its last argument is its HOP's typed spec (every
    HOP of this package states its spec type as ``spec_type``)."""
    spec_type = getattr(node.target, "spec_type", None)
    if spec_type is None:
        raise PassError(f"{target}: {node.format_node()}: {node.target.__name__} states no spec_type")
    typed_spec(node, target, spec_type)


def typed_spec(node: fx.Node, target: str, spec_type: type) -> Any:
    """The node's last argument, checked to be a ``spec_type`` (else ``PassError`` naming both)."""
    spec = node.args[-1] if node.args else None
    if not isinstance(spec, spec_type):
        raise PassError(
            f"{target}: {node.format_node()}: the last argument must be a hops.{spec_type.__name__}, "
            f"got {type(spec).__name__} {spec!r}"
        )
    return spec


def copy_body_into(node: fx.Node, body: fx.GraphModule, inputs: list) -> list:
    """Copy ``body``'s nodes before ``node``, fed ``inputs``; return its outputs (a list).

    What the body's ``get_attr`` nodes read (subgraphs of HOPs inside it, tensor constants)
    moves along to the module that owns ``node``: under its own name where the owner has
    nothing there (or the very same object), else under a fresh name. The owner's attribute
    of the same name is another value (both graphs number their constants from
    ``_tensor_constant0``): a copied node must never read it.
    """
    graph = node.graph
    owner = graph.owning_module
    placeholders = body.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(inputs):
        raise PassError(
            f"{node.format_node()}: its body takes {len(placeholders)} inputs but the node passes {len(inputs)}"
        )
    before = set(graph.nodes)
    with graph.inserting_before(node):
        outputs = graph.graph_copy(body.graph, dict(zip(placeholders, inputs)))
    renamed: dict[str, str] = {}
    missing = object()
    for copied in [n for n in graph.nodes if n not in before and n.op == "get_attr"]:
        target = str(copied.target)
        if target not in renamed:
            value = _attribute(body, target, missing)
            if value is missing:
                raise PassError(f"{node.format_node()}: its body reads {target!r}, which it does not have")
            fresh = target
            if _attribute(owner, target, missing) is not value:
                base = fresh = target.replace(".", "_")
                suffix = 0
                while (present := getattr(owner, fresh, missing)) is not missing and present is not value:
                    suffix += 1
                    fresh = f"{base}_{suffix}"
                if present is missing:
                    _bind(owner, fresh, value)
            renamed[target] = fresh
        copied.target = renamed[target]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _attribute(module: torch.nn.Module, path: str, default: Any) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part, default)
        if value is default:
            return default
    return value


def _bind(owner: torch.nn.Module, name: str, value: Any) -> None:
    """``value`` as ``owner``'s attribute ``name``, as a GraphModule holds it: a module, a
    parameter, a tensor as a buffer, else plain."""
    if isinstance(value, torch.nn.Module):
        owner.register_module(name, value)
    elif isinstance(value, torch.nn.Parameter):
        owner.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(name, value)
    else:
        setattr(owner, name, value)


def replace_tuple_output(node: fx.Node, values: list[Any]) -> None:
    """Make every ``node[i]`` read ``values[i]``, then erase ``node`` and its unused body ``get_attr``."""
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            raise PassError(f"{node.format_node()}: its tuple output is used by {user.format_node()}, not by getitem")
        user.replace_all_uses_with(values[user.args[1]])
        node.graph.erase_node(user)
    body = node.args[0]
    node.graph.erase_node(node)
    for attr in body if isinstance(body, (tuple, list)) else [body]:
        if isinstance(attr, fx.Node) and attr.op == "get_attr" and not attr.users:
            node.graph.erase_node(attr)


class HopRulePass(PassBase):
    """Apply ``target``'s rules to every node of this package's HOPs (see the module docstring)."""

    def __init__(self, target: str, *, name: str | None = None, rules: dict[Any, Rule] | None = None) -> None:
        super().__init__()
        self.target = target
        self.name = name or target
        self.overrides = rules or {}

    def rule(self, node: fx.Node) -> Rule:
        rule = self.overrides.get(node.target) or rule_for(self.target, node.target)
        if rule is None:
            raise PassError(
                f"{self.name}: no {self.target!r} rule for {node.format_node()} "
                f"({node.target.__name__}); register one with passes.register_rule({self.target!r}, hop)"
            )
        return rule

    def __call__(self, graph_module: fx.GraphModule) -> PassResult | None:
        if isinstance(graph_module, fx.GraphModule):  # else ``requires`` refuses it
            own_subgraphs(graph_module)
        return super().__call__(graph_module)

    def requires(self, graph_module: fx.GraphModule) -> None:
        if not isinstance(graph_module, fx.GraphModule):
            raise TypeError(f"{self.name} expects a torch.fx.GraphModule, got {type(graph_module).__name__}")

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        modified = False
        for module in bodies_first(graph_module):
            graph_changed = False
            for node in list(module.graph.nodes):
                if node.op == "call_function" and is_package_hop(node.target):
                    check_spec(node, self.name)
                    rule = self.rule(node)
                    if rule is not keep:
                        rule(node)
                        graph_changed = True
            if graph_changed:
                fill_vals(module.graph)
                module.graph.lint()
                _drop_unreferenced_subgraphs(module)  # e.g. bodies of inlined regions
                module.recompile()
                modified = True
        return PassResult(graph_module, modified)

    def ensures(self, graph_module: fx.GraphModule) -> None:
        """Nothing this target had to rewrite is left (kept HOPs may stay)."""
        for module in graph_modules(graph_module):
            for node in module.graph.nodes:
                if node.op == "call_function" and is_package_hop(node.target) and self.rule(node) is not keep:
                    raise PassError(f"{self.name} left {node.format_node()} in the graph")


def runner_spec(runner: str, spec: Any, spec_type: type) -> Any:
    """``spec`` checked to be a ``spec_type`` where a lowered graph calls a runner (a graph
    may have been edited after lowering): ``TypeError`` naming the runner."""
    if not isinstance(spec, spec_type):
        raise TypeError(f"{runner}: the last argument must be a hops.{spec_type.__name__}, got {type(spec).__name__} {spec!r}")
    return spec


def leaf_call(function: Callable) -> Callable:
    """``function`` as a call FX keeps whole: called on ``fx.Proxy`` arguments (symbolic
    tracing, which is how a pickled GraphModule is rebuilt) it records one node instead of
    running. Lowered graphs call such functions (a scan's runner, a scope's runner)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        proxy = next(
            (a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)), None
        )
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", call, args, kwargs)
        return function(*args, **kwargs)

    call.__name__ = call.__qualname__ = function.__name__
    call.__module__ = function.__module__
    call.__doc__ = function.__doc__
    call.__wrapped__ = function
    return call
