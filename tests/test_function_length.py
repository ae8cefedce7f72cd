"""No function in ``hops/`` or ``passes/`` is longer than 80 lines, its docstring included: a function's
docstring is its contract (arguments, returns, errors, an example), the longer explanation
belongs in the module's docstring, and a longer body is split into named steps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 80


def long_functions(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LIMIT:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_hops_or_passes_is_longer_than_80_lines():
    found = long_functions("hops") + long_functions("passes")
    assert not found, found
