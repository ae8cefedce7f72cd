"""examples/auto_shard.py runs end to end (it checks its own numbers against eager PyTorch)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "auto_shard.py"


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ["2x2", "2x2x1"])
def test_auto_shard_example(mesh):
    """The plan made from the model on the meta device, run on real parameters; on a 2-D and a
    3-D mesh (4 CPU devices: "data" 2, "fsdp" 2, "tensor" 1)."""
    # A fresh process, as a user runs it (not this test process's XLA_USE_SPMD).
    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    with tempfile.TemporaryDirectory() as directory:
        picture = os.path.join(directory, "plan.svg")
        result = subprocess.run(
            [sys.executable, str(EXAMPLE), picture, "--mesh", mesh], capture_output=True, text=True, env=env, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert os.path.getsize(picture) > 0
    out = result.stdout
    axes = {"2x2": "{'data': 2, 'model': 2}", "2x2x1": "{'data': 2, 'fsdp': 2, 'tensor': 1}"}[mesh]
    assert f"# mesh {axes}" in out
    # The annotated program: forward and backward, the layers' body printed once for 4 steps.
    assert out.count("# body lambda_body_0, once for 4 steps") == 1
    assert out.count("# body lambda_bwd_body_0, once for 4 steps") == 1
    # The attention region carries one body per placement option.
    assert "hops_local_map((attention_alternative0_body_0, attention_alternative1_body_0)" in out and "placement=(" in out
    assert "# body attention_alternative1_body_0 (alternative 1): " in out
    assert ", optimal, " in out
    # The attention region's two placement options (the heads over either axis of 2 devices),
    # forward and backward.
    assert out.count(" of 2, cost=") == 2
    # One While (the layers) with the region and the stated shardings; numbers equal eager.
    assert "# forward HLO: 1 While (the layers)" in out and "4 manual-region entries" in out
    assert "gradients of all 12 parameters on 4 XLA devices match eager PyTorch" in out
