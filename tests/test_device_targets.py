"""Loading a lowering target's device rules (``hops.device_targets``, ``hops/_targets.py``)
imports that target only: an eager torch_xla program pays for the XLA target, not for the
sharding solver (networkx, scipy) or the other targets. Each case runs in a fresh process,
where nothing else has imported them yet."""

from __future__ import annotations

import configparser
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

NOT_LOADED = ("passes.solver", "networkx", "passes.dtensor", "passes.unroll", "passes.check")

# Load the entry point as hops does, and report what it imported.
LOAD_THE_ENTRY_POINT = """
import importlib.metadata, json, sys
import hops
from torch._C import DispatchKey
(entry,) = [e for e in importlib.metadata.entry_points(group="hops.device_targets") if e.name == "xla"]
entry.load()
print(json.dumps({
    "loaded": sorted(m for m in sys.modules if m.startswith("passes") or m == "networkx"),
    "xla_rule": DispatchKey.XLA in hops.scan_hop.py_kernels,
}))
"""

# An eager torch_xla program: the first HOP call on an XLA tensor loads the target. (torch_xla
# itself imports networkx: what counts is what the HOP call added.)
AN_EAGER_XLA_PROGRAM = """
import json, sys
import torch, torch_xla
import hops
x = torch.ones(4, 3, device=torch_xla.device())
before = set(sys.modules)
carry, ys = hops.scan(lambda c, x: (c + x, c * 2), torch.zeros(3, device=x.device), x)
assert carry.cpu().tolist() == [4.0, 4.0, 4.0], carry
print(json.dumps({
    "loaded": sorted(m for m in set(sys.modules) - before if m.startswith("passes") or m.startswith("networkx")),
    "xla_rule": True,
}))
"""

# ``import passes`` still gives every name and a complete rule registry, loading on use.
IMPORT_PASSES = """
import json, sys
import hops, passes
before = sorted(m for m in sys.modules if m.startswith("passes.solver") or m == "networkx")
rules = {target: all(passes.rule_for(target, hop) is not None for hop in (hops.scan_hop, hops.local_map_hop))
         for target in ("inline", "xla", "dtensor", "unroll")}
from passes import *  # noqa: F403
names = [name for name in passes.__all__ if name not in globals()]
print(json.dumps({"before": before, "rules": rules, "missing": names, "solver": passes.solver.solve_placements is passes.solve_placements}))
"""


def _run(program: str, **env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env={**os.environ, **env}, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_entry_point_names_the_xla_target():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["options.entry_points"]["hops.device_targets"].split() == ["xla", "=", "passes.xla"]


def test_loading_the_xla_device_rules_imports_neither_the_solver_nor_other_targets():
    report = _run(LOAD_THE_ENTRY_POINT)
    assert report["xla_rule"], "the XLA target registered the scan's XLA rule"
    assert "passes.xla.eager" in report["loaded"]
    assert [m for m in report["loaded"] if m.startswith(NOT_LOADED)] == []


@pytest.mark.xla
def test_an_eager_xla_program_loads_the_xla_target_only():
    report = _run(AN_EAGER_XLA_PROGRAM, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    assert "passes.xla.eager" in report["loaded"]
    assert [m for m in report["loaded"] if m.startswith(NOT_LOADED)] == []


def test_import_passes_gives_every_name_and_every_targets_rules():
    report = _run(IMPORT_PASSES)
    assert report["before"] == [], "the solver loads when first used, not on import"
    assert report["rules"] == {"inline": True, "xla": True, "dtensor": True, "unroll": True}
    assert report["missing"] == []
    assert report["solver"]
