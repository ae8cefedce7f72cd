"""One canary per private torch symbol the package names: when torch moves or removes one, the
test of that symbol fails naming it, on the leg whose torch did.

The symbols are read from the package's source (``from torch._x import y``, ``import torch._x``,
``torch._x.y`` attribute chains, and private modules under public ones such as
``torch.distributed.tensor._ops``), so a new use is covered without being listed here. A symbol some
supported torch lacks is declared in ``hops._compat.PRIVATE_SYMBOLS_SINCE`` with the version
that brought it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from hops import _compat

ROOT = Path(__file__).resolve().parent.parent


def is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]) and "ops" != parts[1]


def named_symbols() -> dict[str, list[str]]:
    """Each private torch symbol named in hops/ and passes/ (the longest dotted name of each
    use), with the files naming it."""
    found: dict[str, set[str]] = {}
    for package in ("hops", "passes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.Attribute):
                    chain, value = [], node
                    while isinstance(value, ast.Attribute):
                        chain.append(value.attr)
                        value = value.value
                    if isinstance(value, ast.Name) and value.id == "torch":
                        names = [".".join(["torch", *reversed(chain)])]
                for name in names:
                    if is_private(name):
                        found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return {
        name: sorted(files)
        for name, files in sorted(found.items())
        if not any(other.startswith(name + ".") for other in found)
    }


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


def test_the_package_names_private_symbols_and_each_declared_one_is_named():
    # The scan finds what it must (a symbol this file's author knows the package uses), and no
    # declaration in _compat outlives its use.
    assert "torch._ops.HigherOrderOperator" in SYMBOLS
    assert not set(_compat.PRIVATE_SYMBOLS_SINCE) - set(SYMBOLS), set(_compat.PRIVATE_SYMBOLS_SINCE) - set(SYMBOLS)


@pytest.mark.parametrize("symbol", list(SYMBOLS))
def test_private_symbol_exists(symbol):
    since = _compat.PRIVATE_SYMBOLS_SINCE.get(symbol)
    if since is not None and _compat.TORCH_VERSION < since:
        # The guard is still needed: the day this torch has it, the declaration can go.
        with pytest.raises((ImportError, AttributeError)):
            resolve(symbol)
        return
    try:
        resolve(symbol)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"torch {_compat.TORCH_VERSION} has no {symbol} (named in {', '.join(SYMBOLS[symbol])}): {error}")


@pytest.mark.parametrize("method", [*_compat.EXPORT_PATCHES, *_compat.IMPORT_PATCHES])
def test_each_method_the_package_may_wrap_exists(method):
    # The methods the package wraps (the export serializer's, lazily; on 2.9 one of Dynamo's at
    # import) are reached through a module alias the symbol scan above does not follow: each
    # gets its own canary, naming it, on the leg whose torch moved it.
    try:
        value = resolve(method)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"torch {_compat.TORCH_VERSION} has no {method} (listed in hops._compat): {error}")
    assert callable(value), f"{method} is a {type(value).__name__}, not a method"
