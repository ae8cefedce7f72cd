"""Context-parallel attention in a local_map region, lowered to XLA manual sharding.

    python examples/local_map_attention.py

An attention block on a 2x2 mesh ("data", "context"): projections run on global tensors
(GSPMD partitions them); a ``hops.local_map`` region computes attention on each device's
local shard, with queries split over the sequence ("context") and keys/values replicated
over it, batch split over "data". Keys and values are replicated inputs, so their
gradients leave the region as Partial sums over "context", derived automatically.

The block is traced with ``make_fx`` (printed) and with AOTAutograd; both graphs carry the
region as one ``hops_local_map`` node with a typed ``LocalMapSpec``. ``passes.lower_to_xla``
turns each region into SPMDFullToShardShape ... SPMDShardToFullShape; the example runs
forward and backward on 4 XLA CPU devices under SPMD, prints the HLO custom calls, and
checks the output and every gradient against single-device eager PyTorch.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import re  # noqa: E402

import torch  # noqa: E402
from functorch.compile import aot_function, make_boxed_func  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import hops  # noqa: E402
import passes  # noqa: E402
from hops import Mesh, Replicate, Shard, ShardingSpec  # noqa: E402

MESH = Mesh((2, 2), ("data", "context"))
QUERIES = (Shard(0), Shard(1))  # batch over "data", sequence over "context"
KEYS_VALUES = (Shard(0), Replicate())  # batch over "data", whole sequence on every device


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of the local queries against all keys (per device)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.softmax(dim=-1) @ v


context_parallel_attention = hops.local_map(
    attention,
    mesh=MESH,
    in_placements=(QUERIES, KEYS_VALUES, KEYS_VALUES),
    out_placements=QUERIES,
)


def attention_block(x, wq, wk, wv, wo):
    x = hops.annotate_sharding(x, ShardingSpec(MESH, QUERIES))
    q, k, v = x @ wq, x @ wk, x @ wv
    out = context_parallel_attention(q, k, v)
    return hops.annotate_sharding(out @ wo + x, ShardingSpec(MESH, QUERIES))


def single_device_block(x, wq, wk, wv, wo):
    """The same block on one device: attention over the whole sequence, no annotations."""
    return attention(x @ wq, x @ wk, x @ wv) @ wo + x


def inputs(batch=4, seq=8, dim=16):
    torch.manual_seed(0)
    x = torch.randn(batch, seq, dim)
    weights = [torch.randn(dim, dim) / dim**0.5 for _ in range(4)]
    return x, *weights


def loss(*args):
    return attention_block(*args).square().mean()


def aot_graphs(*args):
    graphs = {}

    def keep(name):
        def compile_graph(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    aot_function(loss, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(
        *(a.clone().requires_grad_() for a in args)
    ).backward()
    return graphs["forward"], graphs["backward"]


def custom_call_lines(hlo):
    return [
        re.sub(r"\s+", " ", line.strip())
        for line in hlo.splitlines()
        if "custom_call_target" in line or " all-reduce(" in line
    ]


def main():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    args = inputs()

    print("# make_fx graph of the attention block\n")
    print(make_fx(attention_block)(*args).print_readable(print_output=False, include_stride=False))

    forward, backward = aot_graphs(*args)
    passes.lower_to_xla(forward)
    passes.lower_to_xla(backward)

    loss_value, *saved = forward(*(a.to(device) for a in args))
    print("# forward HLO: sharding custom calls and collectives")
    for line in custom_call_lines(torch_xla._XLAC._get_xla_tensors_hlo([loss_value])):
        print("  ", line)
    torch_xla.sync()
    xm.wait_device_ops()  # the backward reads the forward's results: let that execution finish
    grads = backward(*saved, torch.ones((), device=device))
    print("# backward HLO: sharding custom calls and collectives")
    for line in custom_call_lines(torch_xla._XLAC._get_xla_tensors_hlo(list(grads))):
        print("  ", line)

    reference = [a.clone().requires_grad_() for a in args]
    reference_loss = single_device_block(*reference).square().mean()
    reference_loss.backward()
    torch.testing.assert_close(loss_value.cpu(), reference_loss.detach())
    for name, grad, ref in zip(("x", "wq", "wk", "wv", "wo"), grads, reference):
        torch.testing.assert_close(grad.cpu(), ref.grad, msg=f"gradient of {name}")
    print(f"\nloss {loss_value.item():.6f} and the gradients of x, wq, wk, wv, wo match single-device eager")


if __name__ == "__main__":
    main()
