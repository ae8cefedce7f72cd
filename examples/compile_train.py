"""Train a model holding every kind of HOP with ``torch.compile(model, backend="hops_xla")``.

    python examples/compile_train.py

The model: an annotated input projection, a stack of residual layers run by ``hops.scan``
over stacked weights, each with an RMS norm in a ``local_map`` region (rows sharded over
"data") and an annotated activation, on a 2x2 mesh of 4 XLA CPU devices under SPMD.
Dynamo keeps the HOPs, AOTAutograd traces forward and backward graphs with them,
``passes.lower_to_xla`` lowers both, and torch_xla's Dynamo bridge compiles each once and
replays it by hash on later steps. Five SGD steps; the loss of each equals the same steps
run eagerly on CPU.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402

import hops  # noqa: E402
from hops import Mesh, Replicate, Shard, ShardingSpec  # noqa: E402

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
FEATURES = ShardingSpec(MESH, (Shard(0), Shard(1)))


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ScanNet(torch.nn.Module):
    def __init__(self, features: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Parameter(torch.randn(features, features) / features**0.5)
        self.layers = torch.nn.Parameter(torch.randn(layers, features, features) / features**0.5)
        self.norm = hops.local_map(
            rms_norm, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=((Shard(0), Replicate()),)
        )

    def layer(self, h: torch.Tensor, w: torch.Tensor):
        h = h + hops.annotate_sharding(torch.tanh(self.norm(h) @ w), FEATURES)
        return h, h.pow(2).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = hops.annotate_sharding(x @ self.inp, ROWS)
        h, energies = hops.scan(self.layer, h, self.layers)
        return h.pow(2).mean() + energies.mean()


def train(model: torch.nn.Module, step_fn, batches: list[torch.Tensor], sync=lambda: None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        optimizer.zero_grad()
        loss = step_fn(x)
        loss.backward()
        optimizer.step()
        sync()
        losses.append(loss.item())
    return losses


def main() -> None:
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    # torch's autograd engine sizes its per-device queues at the first backward it runs
    # (README, notes for torch_xla users): make that one an XLA backward.
    probe = torch.ones(1, device=device, requires_grad=True)
    (probe * 2).sum().backward()
    torch.manual_seed(0)
    reference_model = ScanNet()
    batches = [torch.randn(8, 16) for _ in range(5)]
    model = ScanNet()
    model.load_state_dict(reference_model.state_dict())
    model = model.to(device)
    compiled = torch.compile(model, backend="hops_xla")
    losses = train(model, compiled, [x.to(device) for x in batches], sync=torch_xla.sync)
    expected = train(reference_model, reference_model, batches)
    for step, (got, want) in enumerate(zip(losses, expected)):
        print(f"step {step}: loss {got:.6f} (eager CPU {want:.6f})")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    print("compiled training on 4 XLA devices matches eager PyTorch on CPU")


if __name__ == "__main__":
    main()
