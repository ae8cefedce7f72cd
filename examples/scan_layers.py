"""A stack of identical layers as one scan: traced, lowered to one XLA While, trained one step.

    python examples/scan_layers.py

Each layer is a block in a named scope: einsum up-projection, a sharding annotation on the
hidden activation (batch over "data", features over "model"), tanh, einsum down-projection
and a residual. ``hops.scan`` runs the block over weights stacked along dim 0, so the
program holds the block once, not N times. AOTAutograd traces the training step; both
graphs carry one ``hops_scan`` whose body keeps the einsum kernels, the annotation and the
named scope. ``passes.lower_to_xla`` turns each scan into one XLA ``While`` with the
``Sharding`` custom call inside its body; the step runs on 4 XLA CPU devices and its loss
and gradients are checked against the unrolled model in eager PyTorch.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import re  # noqa: E402

import torch  # noqa: E402
from functorch.compile import aot_function, make_boxed_func  # noqa: E402

import hops  # noqa: E402
import passes  # noqa: E402
from hops import Mesh, Shard, ShardingSpec  # noqa: E402

MESH = Mesh((2, 2), ("data", "model"))
HIDDEN = ShardingSpec(MESH, (Shard(0), Shard(2)))  # batch over "data", features over "model"
LAYERS, BATCH, SEQ, DIM, FF = 4, 4, 8, 16, 32


@hops.named_scope("block")
def block(h, w_in, w_out):
    up = hops.annotate_sharding(hops.einsum("bsd,df->bsf", h, w_in), HIDDEN)
    return h + hops.einsum("bsf,fd->bsd", torch.tanh(up), w_out)


def layer(h, weights):
    w_in, w_out = weights
    h = block(h, w_in, w_out)
    return h, h.square().mean()  # carry, and one statistic per layer


def scanned_loss(x, w_in, w_out):
    h, per_layer = hops.scan(layer, x, (w_in, w_out))
    return h.square().mean() + per_layer.sum()


def unrolled_loss(x, w_in, w_out):
    """The same model as a Python loop of plain torch ops (the reference)."""
    h, total = x, 0
    for i in range(w_in.shape[0]):
        h = h + torch.tanh(torch.einsum("bsd,df->bsf", h, w_in[i])) @ w_out[i]
        total = total + h.square().mean()
    return h.square().mean() + total


def inputs():
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, DIM)
    w_in = torch.randn(LAYERS, DIM, FF) / DIM**0.5
    w_out = torch.randn(LAYERS, FF, DIM) / FF**0.5
    return x, w_in, w_out


def aot_graphs(args):
    graphs = {}

    def keep(name):
        def compile_graph(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    traced = aot_function(scanned_loss, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    traced(*(a.clone().requires_grad_() for a in args)).backward()
    return graphs["forward"], graphs["backward"]


def loop_lines(hlo):
    """The While and the Sharding custom calls, which sit in the loop's body computation."""
    lines = []
    for line in hlo.splitlines():
        if " while(" in line or 'custom_call_target="Sharding"' in line:
            line = re.sub(r"= \(.*\) while\(", "= (...) while(", line.strip())  # the loop state's long tuple type
            lines.append(re.sub(r"\s+", " ", line)[:160])
    return lines


def main():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    args = inputs()
    forward, backward = aot_graphs(args)
    print("# AOTAutograd forward graph: one scan over", LAYERS, "layers\n")
    print(forward.print_readable(print_output=False, include_stride=False))

    passes.lower_to_xla(forward)
    passes.lower_to_xla(backward)
    loss, *saved = forward(*(a.to(device) for a in args))
    print("# forward HLO: the While and the Sharding inside its body")
    for line in loop_lines(torch_xla._XLAC._get_xla_tensors_hlo([loss])):
        print("  ", line)
    torch_xla.sync()
    xm.wait_device_ops()  # the backward reads the forward's results: let that execution finish
    grads = backward(*saved, torch.ones((), device=device))
    print("# backward HLO: a reverse While, the annotated gradient inside")
    for line in loop_lines(torch_xla._XLAC._get_xla_tensors_hlo(list(grads))):
        print("  ", line)

    reference = [a.clone().requires_grad_() for a in args]
    reference_loss = unrolled_loss(*reference)
    reference_loss.backward()
    torch.testing.assert_close(loss.cpu(), reference_loss.detach(), rtol=1e-4, atol=1e-5)
    for name, grad, ref in zip(("x", "w_in", "w_out"), grads, reference):
        torch.testing.assert_close(grad.cpu(), ref.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    print(f"\nloss {loss.item():.6f} and the gradients of x, w_in, w_out match the unrolled model")


if __name__ == "__main__":
    main()
