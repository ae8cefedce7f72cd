"""The examples run end to end (each checks its own numbers against eager PyTorch)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name, *args):
    # A fresh process as a user runs it: not the XLA_USE_SPMD this test process has set.
    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.xla
def test_sharded_mlp_example():
    forward, backward = run_example("sharded_mlp.py").split("# backward HLO")
    assert forward.count('custom_call_target="Sharding"') == 3
    assert backward.count('custom_call_target="Sharding"') == 2
    assert "gradients match eager PyTorch" in backward


def test_sharded_mlp_example_through_the_jax_target():
    pytest.importorskip("jax", reason="target 'jax' needs jax (the 'jax' extra)")
    forward, backward = run_example("sharded_mlp.py", "--target", "jax").split("# backward StableHLO")
    layouts = [re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])>", text) for text in (forward, backward)]
    # one per annotation, Shardy's: batch rows over "data", hidden features also over "model"
    assert layouts == [['[{"data"}, {}]', '[{"data"}, {"model"}]', '[{"data"}, {}]'], ['[{"data"}, {}]', '[{"data"}, {"model"}]']]
    assert "gradients match eager PyTorch on CPU (target jax, 4 devices)" in backward


@pytest.mark.xla
def test_local_map_attention_example():
    stdout = run_example("local_map_attention.py")
    graph, hlo = stdout.split("# forward HLO")
    assert "torch.ops.higher_order.hops_local_map(attention_body_0" in graph
    forward, backward = hlo.split("# backward HLO")
    # Three inputs enter the region, one output leaves it.
    assert forward.count('"SPMDFullToShardShape"') == 3 and forward.count('"SPMDShardToFullShape"') == 1
    # Keys and values are replicated over "context": their gradients are summed over it.
    assert backward.count("all-reduce(") == 2 and "replica_groups={{0,1},{2,3}}" in backward
    assert "gradients of x, wq, wk, wv, wo match single-device eager" in backward


@pytest.mark.xla
def test_scan_layers_example():
    stdout = run_example("scan_layers.py")
    graph, hlo = stdout.split("# forward HLO")
    assert graph.count("torch.ops.higher_order.hops_scan(") == 1  # the block once, not per layer
    assert "hops_kernel_einsum" in graph and "hops_sharding_annotation" in graph and "hops_named_scope" in graph
    forward, backward = hlo.split("# backward HLO")
    for part in (forward, backward):
        assert part.count(" while(") == 1 and part.count('custom_call_target="Sharding"') == 1
    assert "gradients of x, w_in, w_out match the unrolled model" in backward


def test_readme_snippets_run(tmp_path):
    # The README's Python blocks, in order, as one program a reader would paste (in a fresh
    # process: kernel names are global, as torch.library op names are).
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2
    program = tmp_path / "readme.py"
    program.write_text("\n".join(blocks) + "\nprint('README ran:', type(gm).__name__, tuple(y.shape))\n")
    # From the repository's root, as the README says to run it.
    result = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "README ran: program (4, 4)" in result.stdout


@pytest.mark.xla
def test_compile_train_example():
    stdout = run_example("compile_train.py")
    assert stdout.count("step ") == 5
    assert "compiled training on 4 XLA devices matches eager PyTorch on CPU" in stdout


def test_run_on_dtensor_starts_its_own_processes_without_torchrun():
    # As a newcomer runs it: `python examples/run_on_dtensor.py`, no torchrun (no RANK), one
    # small example; it starts the 4 gloo processes itself, and rank 0 reports the check.
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PJRT_DEVICE", "CPU_NUM_DEVICES")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("XLA_")}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "run_on_dtensor.py"), "sharded_mlp"],
        capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("sharded_mlp: loss and gradients match single-device eager") == 1, result.stdout
