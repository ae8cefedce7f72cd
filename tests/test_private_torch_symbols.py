"""One canary per private torch symbol the package names: when torch moves or removes one, the
test of that symbol fails naming it, on the leg whose torch did.

The symbols are read from the package's source, so a new use is covered without being listed
here: ``from torch._x import y`` and ``import torch._x`` lines, ``torch._x.y`` attribute chains,
and chains through a local name bound to a torch module, class or function (``from
torch._dynamo.variables import higher_order_ops`` then ``higher_order_ops._hop_name_to_variable_class``,
``import torch.utils._pytree as pytree``, ``original = utils.redistribute_cost``,
``getattr(module, "name")``), in the scope that binds it; private modules under public ones
(``torch.distributed.tensor._ops``) and private attributes of public classes
(``DTensor._op_dispatcher``) count. A ``getattr`` with a default is a probe ready for the
name's absence and is not read. A symbol some supported torch lacks is declared in
``hops._compat.PRIVATE_SYMBOLS_SINCE`` (the version that brought it) or ``PRIVATE_SYMBOLS_UNTIL``
(the version from which the package no longer names it). An attribute torch sets on its own
instances cannot be resolved from a name; the one the package relies on is checked below.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from hops import _compat

ROOT = Path(__file__).resolve().parent.parent


def is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]) and "ops" != parts[1]


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _own_nodes(body: list) -> tuple[list, list]:
    """The nodes of one scope (``body``), and the nested scopes (functions, lambdas, classes)
    found in it, whose own bodies are left to their own call."""
    nodes, nested, stack = [], [], list(reversed(body))
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            nested.append(node)
            # Decorators, defaults and base classes are evaluated in the enclosing scope.
            extra = [*getattr(node, "decorator_list", []), *getattr(node, "bases", [])]
            if not isinstance(node, ast.ClassDef):
                extra += [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]
            stack.extend(reversed(extra))
            continue
        nodes.append(node)
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return nodes, nested


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The dotted torch name an expression spells, following ``aliases`` (a local name -> the
    torch module, class or function it is bound to), attribute chains and ``getattr`` with a
    literal name and no default; None when it is not one."""
    chain = []
    while True:
        if isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) == 2  # with a default it is a probe, ready for the name's absence
            and not node.keywords
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            chain.append(node.args[1].value)
            node = node.args[0]
        else:
            break
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(chain)])


def _bound_names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]


def _scan_scope(body: list, outer: dict[str, str], parameters: set[str], found: set[str]) -> None:
    """Add to ``found`` each torch name one scope spells, then scan its nested scopes."""
    nodes, nested = _own_nodes(body)
    aliases = {k: v for k, v in outer.items() if k not in parameters}
    imported: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "torch":
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}")
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    found.add(alias.name)
                    imported[alias.asname or "torch"] = alias.name if alias.asname else "torch"
    aliases.update(imported)
    # Plain assignments of a torch name (``original = utils.redistribute_cost``, tuple unpacking
    # of several); any other binding of a name in this scope hides the outer alias of it.
    assigned: dict[str, str | None] = {}
    for _ in range(2):  # an alias of an alias
        for node in nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(target.elts) == len(node.value.elts):
                        pairs = list(zip(target.elts, node.value.elts))
                    for name_node, value in pairs:
                        if isinstance(name_node, ast.Name):
                            assigned[name_node.id] = _dotted(value, {**aliases, **{k: v for k, v in assigned.items() if v}})
    for node in nodes:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in assigned:
            assigned[node.id] = None
    for name, value in assigned.items():
        if name in imported:
            continue  # bound both ways here: keep the import (the common use)
        if value is None:
            aliases.pop(name, None)
        else:
            aliases[name] = value
    for node in nodes:
        if isinstance(node, (ast.Attribute, ast.Call)):
            name = _dotted(node, aliases)
            if name is not None and name != aliases.get(getattr(node, "id", None)):
                found.add(name)
    for scope in nested:
        if isinstance(scope, ast.ClassDef):
            _scan_scope(scope.body, aliases, set(), found)
            continue
        args = scope.args
        parameters = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        parameters |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        _scan_scope(scope.body if isinstance(scope.body, list) else [scope.body], aliases, parameters, found)


def named_symbols() -> dict[str, list[str]]:
    """Each private torch symbol named in hops/ and passes/ (the longest dotted name of each
    use), with the files naming it."""
    found: dict[str, set[str]] = {}
    for package in ("hops", "passes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            names: set[str] = set()
            _scan_scope(ast.parse(path.read_text(), str(path)).body, {"torch": "torch"}, set(), names)
            for name in names:
                if is_private(name):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return {name: sorted(found[name]) for name in longest(found)}


def longest(names) -> list[str]:
    """The private ``names`` no other one extends (``a._b`` goes when ``a._b.c`` is there)."""
    private = sorted(n for n in names if is_private(n))
    return [n for n in private if not any(other.startswith(n + ".") for other in private)]


SYMBOLS = named_symbols()


def resolve(dotted: str):
    """The object ``dotted`` names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            value = getattr(value, part)
        return value
    raise ImportError(dotted)


# Symbols a review found the package reaching through a local alias (the scan's first version
# missed them): the scan must find each, on the versions whose code names it.
REACHED_THROUGH_ALIASES = (
    "torch._dynamo.variables.higher_order_ops._hop_name_to_variable_class",
    "torch._export.serde.serialize._deserialization_registry",
    "torch._export.serde.serialize.register_extension",
    "torch._export.serde.serialize.ExtensionHandler",
    "torch._export.serde.serialize.Argument.create",
    "torch._inductor.config.post_grad_custom_pre_pass",
    "torch._dynamo.exc.unimplemented",
    "torch._dynamo.exc.unimplemented_v2",
    "torch.distributed.tensor._ops.utils.redistribute_cost",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_to_schema_info",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs",
    "torch._dynamo.variables.lazy.LazyVariableTracker.realize_all",
    "torch._dynamo.variables.tensor.TensorVariable.specialize",
    "torch._dynamo.guards.GuardBuilder.EQUALS_MATCH",
    "torch._dynamo.guards.GuardBuilder.TYPE_MATCH",
    "torch._dynamo.guards.GuardBuilder.SEQUENCE_LENGTH",
    "torch._dynamo.variables.builder.SourcelessBuilder.create",
    "torch._dynamo.variables.constant.ConstantVariable.create",
    "torch._guards.TracingContext.try_get",
    "torch._inductor.graph.SubgraphLowering.__init__",
)


def used_here(symbol: str) -> bool:
    """Whether the package names ``symbol`` on this torch (``PRIVATE_SYMBOLS_UNTIL``)."""
    until = _compat.PRIVATE_SYMBOLS_UNTIL.get(symbol)
    return until is None or _compat.TORCH_VERSION < until


def test_the_package_names_private_symbols_and_each_declared_one_is_named():
    # The scan finds what it must (symbols this file's author knows the package uses, some only
    # through an alias), and no declaration in _compat outlives its use.
    missing = [s for s in ("torch._ops.HigherOrderOperator", *REACHED_THROUGH_ALIASES) if s not in SYMBOLS]
    assert not missing, missing
    declared = set(_compat.PRIVATE_SYMBOLS_SINCE) | set(_compat.PRIVATE_SYMBOLS_UNTIL)
    assert not declared - set(SYMBOLS), declared - set(SYMBOLS)


def test_the_scan_follows_aliases_in_their_scope_only():
    # A name bound to a torch module in one function is that module there, and not in another
    # function that binds the same name to something else (a parameter, a plain value).
    source = textwrap.dedent(
        """
        import torch.utils._pytree as pytree

        def uses():
            from torch._dynamo.variables import higher_order_ops as hoo
            from torch._export.serde import serialize
            table = hoo._hop_name_to_variable_class
            register = getattr(serialize, "register_extension")
            probe = getattr(serialize, "maybe_absent", None)
            return table, register, probe, pytree.tree_map, torch._C._functorch.TransformType

        def shadows(hoo, serialize):
            config = object()
            return hoo._not_torch, serialize._not_torch, config._not_torch
        """
    )
    found: set[str] = set()
    _scan_scope(ast.parse(source).body, {"torch": "torch"}, set(), found)
    assert longest(found) == [
        "torch._C._functorch.TransformType",
        "torch._dynamo.variables.higher_order_ops._hop_name_to_variable_class",
        "torch._export.serde.serialize.register_extension",
        "torch.utils._pytree.tree_map",
    ], sorted(found)


def module_of(symbol: str) -> str:
    """The module ``symbol`` lives in (its longest importable prefix), down to its first private
    part when that module is public (``torch._sync``, ``torch.distributed.tensor.DTensor._op_dispatcher``)."""
    parts = symbol.split(".")
    end = len(parts)
    while end > 1:
        try:
            importlib.import_module(".".join(parts[:end]))
            break
        except ImportError:
            end -= 1
    while not is_private(".".join(parts[:end])):
        end += 1
    return ".".join(parts[:end])


def test_compat_docstring_names_the_module_of_each_private_symbol_used_elsewhere():
    # hops/_compat.py's docstring is where a reader finds every private torch API the package
    # relies on: one named outside _compat (where its wrapper documents it) must be listed there.
    elsewhere = {module_of(s) for s, files in SYMBOLS.items() if set(files) - {"hops/_compat.py"}}
    missing = sorted(m for m in elsewhere if not re.search(f"``{re.escape(m)}(\\.\\w+)*``", _compat.__doc__))
    assert not missing, f"hops/_compat.py's docstring does not list {missing}"


def check(symbol: str) -> None:
    since = _compat.PRIVATE_SYMBOLS_SINCE.get(symbol)
    if since is not None and _compat.TORCH_VERSION < since:
        # The guard is still needed: the day this torch has it, the declaration can go.
        with pytest.raises((ImportError, AttributeError)):
            resolve(symbol)
        return
    try:
        resolve(symbol)
    except (ImportError, AttributeError) as error:
        files = ", ".join(SYMBOLS.get(symbol, ["?"]))
        pytest.fail(f"torch {_compat.TORCH_VERSION} has no {symbol} (named in {files}): {error}")


@pytest.mark.parametrize("symbol", [s for s in SYMBOLS if used_here(s)])
def test_private_symbol_exists(symbol):
    check(symbol)


def test_a_moved_symbol_fails_naming_it():
    # What each canary above reports when torch moves a symbol: its name, not a bare error.
    with pytest.raises(pytest.fail.Exception, match=r"has no torch\._dynamo\.exc\.moved_away"):
        check("torch._dynamo.exc.moved_away")


def test_subgraph_lowering_still_reads_the_donated_inputs_it_is_told_to_forget():
    # ``_compat.undonated_subgraph_inputs`` (torch before 2.15) clears the instance attribute
    # ``bw_donated_idxs`` after ``SubgraphLowering.__init__``: no name resolves an attribute
    # torch sets on its instances, so this reads the source. If torch renamed it, the clearing
    # would silently do nothing and a loop body's inputs would be overwritten again.
    from torch._inductor.graph import SubgraphLowering

    if _compat.TORCH_VERSION >= (2, 15):
        # 2.15 clears it itself: the package leaves the class alone there.
        init = SubgraphLowering.__init__
        _compat.undonated_subgraph_inputs()
        assert SubgraphLowering.__init__ is init
        return

    classes = [c for c in SubgraphLowering.__mro__ if c.__module__ == "torch._inductor.graph"]
    sources = {(c.__name__, name): inspect.getsource(f) for c in classes for name, f in vars(c).items() if inspect.isfunction(f)}
    assigned = [key for key, text in sources.items() if key[1] == "__init__" and "self.bw_donated_idxs =" in text]
    read = [key for key, text in sources.items() if key[1] != "__init__" and "self.bw_donated_idxs" in text]
    assert assigned and read, (
        f"torch {_compat.TORCH_VERSION}: torch._inductor.graph.SubgraphLowering.bw_donated_idxs (cleared in "
        f"hops/_compat.py undonated_subgraph_inputs) is no longer set in __init__ ({assigned}) and read ({read})"
    )


@pytest.mark.parametrize("method", [*_compat.EXPORT_PATCHES, *_compat.COMPILE_PATCHES])
def test_each_method_the_package_may_wrap_exists(method):
    # The methods the package wraps (the export serializer's, lazily; on 2.9 one of Dynamo's at
    # the first scan it traces; before 2.15 inductor's SubgraphLowering.__init__ at the first
    # compile) are also checked as the declared list: each must exist and be callable on the legs that wrap it.
    try:
        value = resolve(method)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"torch {_compat.TORCH_VERSION} has no {method} (listed in hops._compat): {error}")
    assert callable(value), f"{method} is a {type(value).__name__}, not a method"
