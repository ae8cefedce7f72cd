"""The examples run end to end (each checks its own numbers against eager PyTorch)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.xla
def test_sharded_mlp_example():
    # A fresh process as a user runs it: not the XLA_USE_SPMD this test process has set.
    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "sharded_mlp.py")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    forward, backward = result.stdout.split("# backward HLO")
    assert forward.count('custom_call_target="Sharding"') == 3
    assert backward.count('custom_call_target="Sharding"') == 2
    assert "gradients match eager PyTorch" in result.stdout
