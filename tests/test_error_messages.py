"""One error-message convention for every HOP (``hops/_errors.py``, CONTRIBUTING.md): a
message starts with the public function the user called and what names this call
(``scan(step): ``, ``local_map(block): ``, ``einsum('ij,jk->ik'): ``, ``annotate_sharding: ``),
and names a leaf of an argument by its key path (``xs['w']``, ``init[1]``,
``args[0]['w']``), never by its position among the flattened leaves."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

import hops
from hops._errors import PREFIX_PATTERN, call_prefix, leaf_names, public_name
from tests.test_dynamo_errors import BAD_PROGRAMS
from tests.test_targets import package_hops

# A leaf named by its position among flattened leaves (the form the convention replaces).
FLAT_INDEX = re.compile(r"\b(?:leaf|input|output|operand|argument) #?\d+\b")
# A key path from an argument: xs['w'], init[1], args[0]['w'], operands[1].
KEY_PATH = re.compile(r"\b[a-z_]+(?:\[(?:\d+|'[^']*')\])+")

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The modules defining a public function that calls a HOP, and those functions.
HOP_MODULES = ["scan", "local_map", "named_scope", "kernel", "einsum", "sharding_annotation", "_body_hop/base"]
FUNCTIONS = ("scan", "local_map", "named_scope", "kernel", "einsum", "einsum_linear", "patch_linear", "annotate_sharding")
# A literal message head: one of those functions' prefixes, or a constructor's (``ScanSpec(length=...)``).
LITERAL_HEAD = re.compile(rf"^(?:(?:{'|'.join(FUNCTIONS)})(?:\(|: )|[A-Z]\w*(?:\(|: |\.))")
# A message that starts with a value: one built by the shared helper, or a variable holding one.
VALUE_HEADS = {"where", "what", "call", "self.describe()", "kernel_hop.describe()"}


def message_of(program):
    with pytest.raises(Exception) as raised:
        program(torch.randn(8, 4))
    return str(raised.value)


@pytest.mark.parametrize("name, function, program, expected, pattern", BAD_PROGRAMS, ids=[case[0] for case in BAD_PROGRAMS])
def test_every_typed_error_starts_with_its_functions_one_prefix(name, function, program, expected, pattern):
    message = message_of(program)
    match = re.match(PREFIX_PATTERN, message)
    assert match is not None and match.group(1) == function, f"{name}: {message}"
    assert not FLAT_INDEX.search(message), f"{name}: a leaf named by flat index: {message}"


@pytest.mark.parametrize(
    "name, function, program, expected, pattern",
    [case for case in BAD_PROGRAMS if KEY_PATH.search(case[4].replace("\\", ""))],
    ids=[case[0] for case in BAD_PROGRAMS if KEY_PATH.search(case[4].replace("\\", ""))],
)
def test_leaves_are_named_by_key_path(name, function, program, expected, pattern):
    message = message_of(program)
    named = KEY_PATH.findall(message)
    assert named, f"{name}: names no leaf by key path: {message}"
    for path in named:
        assert path.split("[")[0] in {"xs", "init", "args", "kwargs", "operands", "output", "in_placements", "out_placements"}, path


def test_every_hop_of_the_package_has_error_cases():
    # A new HOP gets a row in tests/test_dynamo_errors.py's table (and so this file's checks).
    functions = {case[1] for case in BAD_PROGRAMS}
    missing = {public_name(hop) for hop in package_hops()} - functions
    assert not missing, f"no error case for {sorted(missing)}"


def test_raise_sites_start_with_a_prefix_of_the_convention():
    # Every error the HOP modules build from a message starts with a literal prefix of the
    # convention or with a value built by hops._errors' helpers: a new raise site written
    # another way ("scan step: ...", "{name} writes ...") fails here.
    wrong = []
    for module in HOP_MODULES:
        path = ROOT / "hops" / f"{module}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Name, ast.Attribute))):
                continue
            called = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if not (called.endswith("Error") or called == "TracingRefusal"):
                continue
            message = node.args[0]
            head = message.values[0] if isinstance(message, ast.JoinedStr) else message
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                ok = LITERAL_HEAD.match(head.value) is not None
            elif isinstance(head, ast.FormattedValue):
                source = ast.unparse(head.value)
                ok = source in VALUE_HEADS or source.startswith(("hop_prefix(", "call_prefix("))
            else:
                continue  # a message computed elsewhere
            if not ok:
                wrong.append(f"hops/{module}.py:{node.lineno}: {ast.unparse(message)[:80]}")
    assert not wrong, "\n".join(wrong)


def test_the_shared_helpers():
    assert call_prefix("scan", "step") == "scan(step)" and call_prefix("annotate_sharding") == "annotate_sharding"
    assert leaf_names("xs", [torch.ones(1), {"w": torch.ones(1)}, (torch.ones(1),)]) == ["xs[0]", "xs[1]['w']", "xs[2][0]"]
    assert leaf_names("init", torch.ones(1)) == ["init"]
    assert public_name(hops.scan_hop) == "scan" and public_name(hops.sharding_annotation_hop) == "annotate_sharding"
