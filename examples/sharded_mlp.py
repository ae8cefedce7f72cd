"""Trace an annotated MLP, lower it to XLA, and read the sharding custom calls in the HLO.

    python examples/sharded_mlp.py

1. A two-layer MLP annotates its activations with ``hops.annotate_sharding`` on a 2x2 mesh
   ("data", "model"): batch split over "data", hidden features split over "model".
2. AOTAutograd traces it (on CPU) into forward and backward graphs; the annotations are
   ``hops_sharding_annotation`` nodes with typed specs in both.
3. ``passes.lower_to_xla`` rewrites them into functional ``hops_xla`` ops; the graphs run
   on XLA tensors under SPMD on 4 CPU devices and the HLO holds one
   ``custom_call_target="Sharding"`` per annotation, forward and backward.
4. The loss and gradients are checked against eager PyTorch on CPU.

Where torch_xla is absent (it exists only for torch 2.9), or with ``--target jax``, steps 3-4
go through target ``"jax"`` instead: ``passes.lower_to_jax`` makes each graph a JAX function,
jitted on 4 virtual CPU devices; its StableHLO holds one ``sdy.sharding_constraint`` (Shardy)
per annotation, forward and backward.

    python examples/sharded_mlp.py --target jax
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
# jax reads this when first imported: 4 virtual CPU devices for target "jax"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402
from functorch.compile import aot_function, make_boxed_func  # noqa: E402

import hops  # noqa: E402
import passes  # noqa: E402
from hops import Mesh, Replicate, Shard, ShardingSpec  # noqa: E402

MESH = Mesh((2, 2), ("data", "model"))
BATCH = ShardingSpec(MESH, (Shard(0), Replicate()))  # rows over "data"
HIDDEN = ShardingSpec(MESH, (Shard(0), Shard(1)))  # rows over "data", features over "model"


class MLP(torch.nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(features, hidden) / features**0.5)
        self.down = torch.nn.Parameter(torch.randn(hidden, features) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = hops.annotate_sharding(x, BATCH)
        h = hops.annotate_sharding(x @ self.up, HIDDEN)
        return hops.annotate_sharding(h.relu() @ self.down, BATCH)


def trace(model: MLP, x: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's forward and backward graphs of ``loss(params, x)``."""
    graphs = {}

    def keep(name):
        def compile_graph(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    def loss(up, down, x):
        return torch.func.functional_call(model, {"up": up, "down": down}, (x,)).square().mean()

    traced = aot_function(loss, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    traced(model.up, model.down, x).backward()
    return graphs["forward"], graphs["backward"]


def sharding_lines(hlo: str) -> list[str]:
    return [line.strip() for line in hlo.splitlines() if 'custom_call_target="Sharding"' in line]


def main_on_jax() -> None:
    import jax
    import numpy as np

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    forward, backward = trace(model, x)
    print("# forward graph, as AOTAutograd traced it\n")
    print(forward.print_readable(print_output=False, include_stride=False))

    forward_jax = jax.jit(passes.lower_to_jax(forward))
    backward_jax = jax.jit(passes.lower_to_jax(backward))
    params = [model.up.detach().numpy(), model.down.detach().numpy()]
    print("# forward StableHLO: Shardy sharding constraints")
    for line in forward_jax.lower(*params, x.numpy()).as_text().splitlines():
        if "sdy.sharding_constraint" in line:
            print("  ", line.strip())
    loss, *saved = forward_jax(*params, x.numpy())
    tangent = np.ones((), np.float32)
    print("# backward StableHLO: Shardy sharding constraints")
    for line in backward_jax.lower(*saved, tangent).as_text().splitlines():
        if "sdy.sharding_constraint" in line:
            print("  ", line.strip())
    grad_up, grad_down, _ = backward_jax(*saved, tangent)

    model.zero_grad()
    reference = model(x).square().mean()
    reference.backward()
    torch.testing.assert_close(torch.from_numpy(np.array(loss)), reference.detach())
    torch.testing.assert_close(torch.from_numpy(np.array(grad_up)), model.up.grad)
    torch.testing.assert_close(torch.from_numpy(np.array(grad_down)), model.down.grad)
    print(f"\nloss {float(loss):.6f} and gradients match eager PyTorch on CPU (target jax, {jax.device_count()} devices)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", choices=("xla", "jax"), default="xla" if importlib.util.find_spec("torch_xla") else "jax",
        help="lower through torch_xla (torch 2.9 only) or through target 'jax' (default: xla where torch_xla is installed)",
    )
    if parser.parse_args().target == "jax":
        return main_on_jax()
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    forward, backward = trace(model, x)
    print("# forward graph, as AOTAutograd traced it\n")
    print(forward.print_readable(print_output=False, include_stride=False))

    passes.lower_to_xla(forward)
    passes.lower_to_xla(backward)

    params = [model.up.detach().to(device), model.down.detach().to(device)]
    loss, *saved = forward(*params, x.to(device))
    print("# forward HLO: sharding custom calls")
    for line in sharding_lines(torch_xla._XLAC._get_xla_tensors_hlo([loss])):
        print("  ", re.sub(r"\s+", " ", line))
    torch_xla.sync()
    xm.wait_device_ops()  # the backward reads the forward's results: let that execution finish
    grad_up, grad_down, _ = backward(*saved, torch.ones((), device=device))
    print("# backward HLO: sharding custom calls")
    for line in sharding_lines(torch_xla._XLAC._get_xla_tensors_hlo([grad_up, grad_down])):
        print("  ", re.sub(r"\s+", " ", line))

    model.zero_grad()
    reference = model(x).square().mean()
    reference.backward()
    torch.testing.assert_close(loss.cpu(), reference.detach())
    torch.testing.assert_close(grad_up.cpu(), model.up.grad)
    torch.testing.assert_close(grad_down.cpu(), model.down.grad)
    print(f"\nloss {loss.item():.6f} and gradients match eager PyTorch on CPU")


if __name__ == "__main__":
    main()
