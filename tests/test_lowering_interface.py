"""``passes/`` builds on the declared surface of ``hops`` (``hops.lowering`` and the public
HOP modules), never on a private ``hops`` name: a name or a module starting with ``_``."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def private_hops_uses(source: str, filename: str = "<source>") -> list[str]:
    """Each place ``source`` reaches a private ``hops`` name: ``from hops.x import _y``,
    ``from hops import _x``, ``from hops._x import y``, ``import hops._x``, and attribute access
    ``hops._x`` / ``hops.x._y`` (also through an alias of ``hops`` or of one of its modules)."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> the hops module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name != "hops" and not alias.name.startswith("hops."):
                    continue
                if _is_private(alias.name):
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    modules["hops"] = "hops"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module != "hops" and not node.module.startswith("hops."):
                continue
            for alias in node.names:
                if _is_private(node.module) or alias.name.startswith("_"):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
                elif _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in modules and isinstance(node.ctx, ast.Load):
            dotted = ".".join([modules[value.id], *reversed(chain)])
            # Report each access once, at its outermost private attribute.
            if node.attr.startswith("_") and not _is_private(".".join([modules[value.id], *reversed(chain[1:])])):
                found.append(f"{filename}:{node.lineno}: {dotted}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "from hops.scan import _split",
        "from hops.scan import scan_hop, _length as length",
        "from hops import _layout",
        "from hops._layout import local_shape",
        "import hops._targets",
        "import hops._targets as targets",
        "import hops\nhops._compat.x",
        "import hops\nhops.scan._split(a, b)",
        "import hops.scan\nhops.scan._run_steps",
        "import hops as h\nh._body",
        "from hops import scan\nscan._slice_examples(xs)",
        "from hops import scan as s\ns._length",
        "def f():\n    from hops._subgraph import body_name",
    ],
)
def test_each_form_of_private_use_is_found(source):
    assert private_hops_uses(source), source


@pytest.mark.parametrize(
    "source",
    [
        "from hops.lowering import split_scan_operands, scan_length",
        "from hops.scan import ScanSpec, scan_hop",
        "import hops\nhops.lowering.body_name\nhops.scan_hop",
        "from hops import lowering\nlowering.local_shape",
        "from passes import _infra\n_infra.RULES",
        "import torch\ntorch._C._dispatch_keys",
        "x = obj._private  # not hops",
    ],
)
def test_public_use_is_not_flagged(source):
    assert private_hops_uses(source) == []


def test_passes_reach_no_private_hops_name():
    found = []
    for path in sorted((ROOT / "passes").rglob("*.py")):
        found += private_hops_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "passes/ must build on hops.lowering and the public hops modules:\n" + "\n".join(found)


def test_lowering_interface_names_are_public_and_present():
    import hops.lowering

    assert hops.lowering.__all__, "hops.lowering declares its names"
    for name in hops.lowering.__all__:
        assert not name.startswith("_")
        assert getattr(hops.lowering, name) is not None
        assert name in hops.lowering.__doc__, f"hops.lowering's docstring states the contract of {name}"
