"""Let the solver shard a LLaMA-style decoder, then run its plan on 4 XLA CPU devices.

    python examples/auto_shard.py [picture.png|picture.svg] [--mesh 2x2] [--axes data,model]

1. The model: token embedding, then layers of RMSNorm, attention (rotary embeddings, grouped
   query heads; the attention itself a ``hops.local_map`` region on each device's batch and
   heads, with one placement option per mesh axis the solver chooses from: the heads split
   over that axis, the batch over the others), RMSNorm and a SwiGLU MLP, run by ``hops.scan``
   over weights stacked along dim 0; a final norm, the output projection and cross-entropy.
2. The plan is made without the model's numbers, as for a model too big for one host: the
   parameters are built on the meta device (``with torch.device("meta")``), and AOTAutograd
   traces the training step on fake tensors into forward and backward graphs (one scan each,
   the region inside).
3. ``passes.solve_placements`` places every value on the mesh (``--mesh``: any rank, e.g.
   ``2x2`` ("data", "model"), ``2x2x1`` ("data", "fsdp", "tensor"); its devices must number 4
   here to run) for a TPU v5e-like cost model; the scan body is solved once, for every layer.
4. ``passes.format_placements`` prints the annotated program, ``passes.draw_placements``
   draws it.
5. ``passes.apply_placements`` states the plan as sharding annotations (checked by
   ``passes.check_placements``), ``passes.lower_to_xla`` lowers both graphs; only then are real
   parameters made, and the step runs on 4 XLA CPU devices under SPMD; loss and every gradient
   are checked against eager PyTorch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hops  # noqa: E402
import passes  # noqa: E402
from hops import Mesh, Replicate, Shard  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 64
    ffn: int = 64
    layers: int = 4
    batch: int = 4
    seq: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


LAYER_WEIGHTS = ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2")


def init_params(config: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Embedding, per-layer weights stacked along dim 0, final norm and output projection.
    Under ``with torch.device("meta")`` they are meta tensors: shapes only, no memory."""
    generator = torch.Generator().manual_seed(seed)
    L, D, F_, V = config.layers, config.dim, config.ffn, config.vocab
    q, kv = config.heads * config.head_dim, config.kv_heads * config.head_dim

    def normal(*shape, scale):
        return torch.randn(*shape, generator=generator) * scale

    return {
        "embedding": normal(V, D, scale=1.0),
        "attention_norm": torch.ones(L, D),
        "wq": normal(L, D, q, scale=D**-0.5),
        "wk": normal(L, D, kv, scale=D**-0.5),
        "wv": normal(L, D, kv, scale=D**-0.5),
        "wo": normal(L, q, D, scale=q**-0.5 / L),
        "ffn_norm": torch.ones(L, D),
        "w1": normal(L, D, F_, scale=D**-0.5),
        "w3": normal(L, D, F_, scale=D**-0.5),
        "w2": normal(L, F_, D, scale=F_**-0.5 / L),
        "norm": torch.ones(D),
        "output": normal(D, V, scale=D**-0.5),
    }


def constants(config: Config) -> dict[str, torch.Tensor]:
    """Rotary tables and the causal mask (True above the diagonal: a future position)."""
    half = config.head_dim // 2
    angles = torch.arange(config.seq)[:, None] / 10000 ** (torch.arange(half) / half)
    return {
        "cos": torch.cat([angles.cos()] * 2, -1)[:, None, :],
        "sin": torch.cat([angles.sin()] * 2, -1)[:, None, :],
        "future": torch.ones(config.seq, config.seq, dtype=torch.bool).triu(1),
    }


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-second, first), -1) * sin


def make_loss(config: Config, mesh: Mesh, *, unrolled: bool = False):
    """The training loss ``loss(tokens, targets, params, consts)`` of the decoder on ``mesh``
    (``unrolled``: the layers as a Python loop instead of a scan, for comparisons)."""
    H, KV, HD = config.heads, config.kv_heads, config.head_dim
    # The attention region: each device computes the heads it holds of the batch rows it holds.
    # One option per mesh axis for the solver: the heads split over that axis, the batch over
    # the others (on a 2x2 mesh: heads over "model" and batch over "data", or the other way).
    options = attention_placements(config, mesh)
    whole = tuple(Replicate() for _ in mesh.shape)

    def attention(q, k, v, future):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) * HD**-0.5
        scores = scores.masked_fill(future, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).contiguous()

    first, *others = options
    local_attention = hops.local_map(
        attention,
        mesh=mesh,
        in_placements=(first, first, first, whole),
        out_placements=first,
        alternatives=[dict(in_placements=(o, o, o, whole), out_placements=o) for o in others],
    )

    def layer(h, weights, consts):
        norm_a, wq, wk, wv, wo, norm_f, w1, w3, w2 = weights
        b, s, _ = h.shape
        x = rms_norm(h, norm_a)
        q = rotate((x @ wq).view(b, s, H, HD), consts["cos"], consts["sin"])
        k = rotate((x @ wk).view(b, s, KV, HD), consts["cos"], consts["sin"])
        v = (x @ wv).view(b, s, KV, HD)
        k = k[:, :, :, None].expand(b, s, KV, H // KV, HD).reshape(b, s, H, HD)  # grouped heads
        v = v[:, :, :, None].expand(b, s, KV, H // KV, HD).reshape(b, s, H, HD)
        h = h + local_attention(q, k, v, consts["future"]).reshape(b, s, H * HD) @ wo
        x = rms_norm(h, norm_f)
        return h + (F.silu(x @ w1) * (x @ w3)) @ w2, None

    def loss(tokens, targets, params, consts):
        h = F.embedding(tokens, params["embedding"])
        stacked = tuple(params[name] for name in LAYER_WEIGHTS)
        if unrolled:
            for i in range(config.layers):
                h, _ = layer(h, tuple(w[i] for w in stacked), consts)
        else:
            h, _ = hops.scan(lambda carry, weights: layer(carry, weights, consts), h, stacked)
        logits = rms_norm(h, params["norm"]) @ params["output"]
        return F.cross_entropy(logits.view(-1, config.vocab), targets.view(-1))

    return loss


def attention_placements(config: Config, mesh: Mesh) -> list[tuple]:
    """The attention region's layouts of ``[batch, seq, heads, head_dim]``: the heads split over
    one mesh axis, the batch over every other. The heads' axis is the last one of more than one
    device or any axis of its size (each alternative gives the body the same local shapes), the
    last first; layouts that do not split evenly are left out."""
    sizes = [n for n in mesh.shape if n > 1] or [1]
    options = []
    for heads_axis in reversed(range(mesh.ndim)):
        if mesh.shape[heads_axis] != sizes[-1]:
            continue
        batch_ways = math.prod(n for axis, n in enumerate(mesh.shape) if axis != heads_axis)
        if config.batch % batch_ways or config.heads % mesh.shape[heads_axis]:
            continue
        options.append(tuple(Shard(2) if axis == heads_axis else Shard(0) for axis in range(mesh.ndim)))
    if not options:
        raise ValueError(
            f"the decoder's batch {config.batch} and heads {config.heads} split evenly over no layout of mesh "
            f"{dict(zip(mesh.axis_names, mesh.shape))} (heads over one axis, batch over the others)"
        )
    return options


DEFAULT_AXIS_NAMES = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "tensor")}


def parse_mesh(shape: str, axes: str | None = None) -> Mesh:
    """``parse_mesh("4x4x4", "data,fsdp,tensor")``; axis names default to ``DEFAULT_AXIS_NAMES``
    of the mesh's rank (``axis0, axis1, ...`` beyond)."""
    try:
        sizes = tuple(int(n) for n in shape.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must be sizes joined by 'x' (e.g. 2x2 or 4x4x4), got {shape!r}") from None
    names = tuple(axes.split(",")) if axes else DEFAULT_AXIS_NAMES.get(len(sizes), tuple(f"axis{i}" for i in range(len(sizes))))
    return Mesh(sizes, names)


def example_inputs(config: Config, seed: int = 0) -> tuple:
    """``(tokens, targets, params, consts)``; meta tensors under ``with torch.device("meta")``."""
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq), generator=generator)
    targets = torch.randint(0, config.vocab, (config.batch, config.seq), generator=generator)
    return tokens, targets, init_params(config, seed), constants(config)


def trace_training_step(loss, tokens, targets, params, consts, *, device: str = "cpu"):
    """AOTAutograd's forward and backward graphs of ``loss``; the inputs are
    ``(tokens, targets, *params.values(), *consts.values())``, parameters need gradients.

    Real, fake or meta tensors: meta tensors are traced as fake tensors on ``device`` (the
    graphs then read as if traced on it), so a model built on the meta device is never
    materialized; no input's values are read."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = [tokens, targets, *params.values(), *consts.values()]
    if any(t.device.type == "meta" for t in inputs):
        with FakeTensorMode():
            fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in inputs]
            return _trace(loss, fakes, list(params), list(consts), aot_function, make_boxed_func)
    return _trace(loss, inputs, list(params), list(consts), aot_function, make_boxed_func)


def _trace(loss, inputs, names, const_names, aot_function, make_boxed_func):
    graphs = {}

    def keep(name):
        def compile_graph(gm, example):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    def flat_loss(tokens, targets, *tensors):
        return loss(
            tokens, targets, dict(zip(names, tensors[: len(names)])), dict(zip(const_names, tensors[len(names) :]))
        )

    tokens, targets, *tensors = inputs
    leaves = [p.detach().requires_grad_() for p in tensors[: len(names)]]
    aot_function(flat_loss, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(
        tokens, targets, *leaves, *tensors[len(names) :]
    ).backward()
    return graphs["forward"], graphs["backward"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("picture", nargs="?", default=os.path.join(tempfile.gettempdir(), "auto_shard.png"))
    parser.add_argument("--mesh", default="2x2", help="mesh shape, sizes joined by 'x' (4 devices to run here)")
    parser.add_argument("--axes", default=None, help="axis names joined by ',' (default: data,model / data,fsdp,tensor)")
    args = parser.parse_args()
    mesh = parse_mesh(args.mesh, args.axes)
    devices = int(os.environ["CPU_NUM_DEVICES"])
    if mesh.size != devices:
        parser.error(f"--mesh {args.mesh} has {mesh.size} devices; this example runs on {devices} XLA CPU devices")

    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    picture = args.picture

    config = Config()
    loss = make_loss(config, mesh)
    # The plan needs the model's shapes only: it is made from a model on the meta device.
    with torch.device("meta"):
        meta_inputs = example_inputs(config)
    forward, backward = trace_training_step(loss, *meta_inputs)

    solution = passes.solve_placements((forward, backward), mesh, cost_model=passes.CostModel.preset("tpu-v5e"))
    print(f"# mesh {dict(zip(mesh.axis_names, mesh.shape))}")
    print(passes.format_placements((forward, backward), solution))
    stats = solution.stats
    print(
        f"# solved: {stats['graph_nodes']} graph nodes, {stats['choices']} choices, {stats['choices_in_ilp']} left "
        f"after exact reductions, {stats['variables']} ILP variables, {stats['status']}, "
        f"{stats['graph_seconds'] + stats['build_seconds'] + stats['solve_seconds']:.2f} s"
    )
    print("# picture:", passes.draw_placements((forward, backward), solution, picture))

    passes.apply_placements((forward, backward), solution)
    passes.check_placements(forward)
    passes.check_placements(backward)
    passes.lower_to_xla(forward)
    passes.lower_to_xla(backward)
    # Only now the real parameters: the plan runs on them.
    tokens, targets, params, consts = example_inputs(config)
    inputs = [tokens, targets, *params.values(), *consts.values()]
    step_loss, *saved = forward(*(t.to(device) for t in inputs))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([step_loss, *saved])
    torch_xla.sync()
    xm.wait_device_ops()  # the backward reads the forward's results: let that execution finish
    grads = backward(*saved, torch.ones((), device=device))
    torch_xla.sync()
    xm.wait_device_ops()
    shardings = hlo.count('custom_call_target="Sharding"')
    print(
        f"# forward HLO: {hlo.count(' while(')} While (the layers), {shardings} Sharding custom calls, "
        f"{hlo.count('SPMDFullToShardShape')} manual-region entries"
    )

    reference_params = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    reference = loss(tokens, targets, reference_params, consts)
    reference.backward()
    torch.testing.assert_close(step_loss.cpu(), reference.detach(), rtol=1e-4, atol=1e-5)
    for name, grad in zip(params, grads[2:]):
        torch.testing.assert_close(grad.cpu(), reference_params[name].grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    print(
        f"loss {step_loss.item():.6f} and the gradients of all {len(params)} parameters on {mesh.size} XLA devices "
        "match eager PyTorch"
    )


if __name__ == "__main__":
    main()
