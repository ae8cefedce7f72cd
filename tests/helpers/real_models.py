"""Real model code nobody here wrote, built tiny and randomly initialised (no download):
HF ``transformers``' ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` (eager and SDPA attention),
its Qwen3, Mistral and OPT (also with a left-padded attention mask) and ``torchtitan``'s
Llama 3 (SDPA), for ``tests/test_real_models.py``.

A ``RealModel`` is the plain model with what a user needs to restructure it: its decoder
layers, the code before and after them (``embed``, ``head``), and what the model passes each
layer besides the hidden states (``layer_inputs``, recorded by a forward pre-hook on the first
layer during one plain forward). ``ScannedDecoder`` is the same model whose layers run as one
``hops.scan`` over their weights stacked with ``torch.func.stack_module_state``, one layer
called with ``torch.func.functional_call`` as the step (the layers' other inputs closed over).

The libraries are imported on use: a test module skips (with the reason) where one does not
import, before calling anything here.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import hops
from hops import Mesh, Shard

BATCH, SEQ, VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 2, 16, 256, 64, 4, 2, 2
MESH = Mesh((2, 2), ("data", "model"))
# [batch, heads, seq, head_dim] laid out per device: the batch over "data", the heads over "model".
HEADS_SHARDED = (Shard(0), Shard(1))


@dataclasses.dataclass
class RealModel:
    """A plain model and its parts: ``logits(ids)`` is the model's own forward."""

    name: str
    model: torch.nn.Module
    layers_path: str  # attribute path of the layer container ("model.layers")
    embed: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    head: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    layer_inputs: tuple[tuple, dict] = ((), {})

    @property
    def layers(self) -> list[torch.nn.Module]:
        return list(_container(self.model, self.layers_path).values() if self.is_dict else _container(self.model, self.layers_path))

    @property
    def is_dict(self) -> bool:
        return isinstance(_container(self.model, self.layers_path), torch.nn.ModuleDict)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.forward(self.model, ids)

    def replace_layer(self, index: int, module: torch.nn.Module) -> None:
        container = _container(self.model, self.layers_path)
        container[list(container.keys())[index] if self.is_dict else index] = module


def _container(model: torch.nn.Module, path: str) -> torch.nn.Module:
    module = model
    for part in path.split("."):
        module = getattr(module, part)
    return module


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def example_ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, targets


def record_layer_inputs(real: RealModel, ids: torch.Tensor) -> RealModel:
    """``real`` with ``layer_inputs``: what its forward passes the first layer besides the
    hidden states (masks, position embeddings, flags), recorded by a forward pre-hook."""
    recorded = {}

    def hook(module, args, kwargs):
        recorded["inputs"] = (tuple(args[1:]), dict(kwargs))

    handle = real.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            real.logits(ids)
    finally:
        handle.remove()
    real.layer_inputs = recorded["inputs"]
    return real


# --------------------------------------------------------------------------- the models


def hf_llama(attention: str, seed: int = 0) -> RealModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2 * SEQ,
        use_cache=False,
        attn_implementation=attention,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).train()
    return RealModel(
        f"hf_llama_{attention}",
        model,
        "model.layers",
        embed=lambda m, ids: m.model.embed_tokens(ids),
        head=lambda m, h: m.lm_head(m.model.norm(h)),
        forward=lambda m, ids: m(ids).logits,
    )


def hf_gpt2(attention: str, seed: int = 0) -> RealModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=2 * SEQ,
        n_embd=DIM,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation=attention,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).train()

    def embed(m, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return m.transformer.drop(m.transformer.wte(ids) + m.transformer.wpe(positions))

    return RealModel(
        f"hf_gpt2_{attention}",
        model,
        "transformer.h",
        embed=embed,
        head=lambda m, h: m.lm_head(m.transformer.ln_f(h)),
        forward=lambda m, ids: m(ids).logits,
    )


def left_padding_mask() -> torch.Tensor:
    """A batch's ``attention_mask`` with left padding: the second row's first 5 tokens are pads."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :5] = 0
    return mask


def _hf_decoder(family: str, attention: str, padded: bool, seed: int) -> RealModel:
    """HF ``transformers``' Qwen3 (query/key norms), Mistral (a sliding window of half the
    sequence) or OPT (learned positions from the attention mask, biases, LayerNorm, a tied
    head), tiny. ``padded``: the model is called with a left-padded ``attention_mask`` (a
    non-persistent buffer ``attention_mask``, so tracers see it as the model's input)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  max_position_embeddings=2 * SEQ, use_cache=False, attn_implementation=attention)
    if family == "qwen3":
        config = transformers.Qwen3Config(intermediate_size=2 * DIM, num_key_value_heads=KV_HEADS, head_dim=DIM // HEADS, **common)
        model_class, layers_path = transformers.Qwen3ForCausalLM, "model.layers"
    elif family == "mistral":
        config = transformers.MistralConfig(intermediate_size=2 * DIM, num_key_value_heads=KV_HEADS, sliding_window=SEQ // 2, **common)
        model_class, layers_path = transformers.MistralForCausalLM, "model.layers"
    else:
        config = transformers.OPTConfig(ffn_dim=2 * DIM, dropout=0.0, attention_dropout=0.0, **common)
        model_class, layers_path = transformers.OPTForCausalLM, "model.decoder.layers"
    torch.manual_seed(seed)
    model = model_class(config).train()
    if padded:
        model.register_buffer("attention_mask", left_padding_mask(), persistent=False)

    def mask_of(m):
        return getattr(m, "attention_mask", None)

    if family == "opt":

        def embed(m, ids):
            decoder = m.model.decoder
            mask = mask_of(m)
            mask = torch.ones(ids.shape, dtype=torch.long, device=ids.device) if mask is None else mask
            return decoder.embed_tokens(ids) + decoder.embed_positions(mask, 0)

        head = lambda m, h: m.lm_head(m.model.decoder.final_layer_norm(h))  # noqa: E731
    else:
        embed = lambda m, ids: m.model.embed_tokens(ids)  # noqa: E731
        head = lambda m, h: m.lm_head(m.model.norm(h))  # noqa: E731
    return RealModel(
        f"hf_{family}_{attention}" + "_padded" * padded,
        model,
        layers_path,
        embed=embed,
        head=head,
        forward=lambda m, ids: m(ids, attention_mask=mask_of(m)).logits,
    )


def torchtitan_llama3(seed: int = 0) -> RealModel:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    args = TransformerModelArgs(
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        vocab_size=VOCAB,
        multiple_of=32,
        max_seq_len=2 * SEQ,
        rope_theta=500000,
    )
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return RealModel(
        "torchtitan_llama3",
        model,
        "layers",
        embed=lambda m, ids: m.tok_embeddings(ids),
        head=lambda m, h: m.output(m.norm(h)),
        forward=lambda m, ids: m(ids),
    )


def build(name: str, seed: int = 0) -> RealModel:
    """The model ``name`` (``hf_llama_eager``, ``hf_llama_sdpa``, ``hf_gpt2_eager``,
    ``hf_gpt2_sdpa``, ``torchtitan_llama3``; ``hf_{qwen3,mistral,opt}_{eager,sdpa}``, with
    ``_padded`` for a left-padded attention mask), its layer inputs recorded."""
    if name == "torchtitan_llama3":
        real = torchtitan_llama3(seed)
    else:
        family, attention, *padded = name.removeprefix("hf_").split("_")
        if family in ("qwen3", "mistral", "opt"):
            real = _hf_decoder(family, attention, padded == ["padded"], seed)
        else:
            real = {"llama": hf_llama, "gpt2": hf_gpt2}[family](attention, seed)
    return record_layer_inputs(real, example_ids()[0])


# --------------------------------------------------------------------------- scanned layers


class ScannedDecoder(torch.nn.Module):
    """``real``'s model (a copy) whose layers run as one ``hops.scan``: the layers' parameters
    and buffers stacked (``torch.func.stack_module_state``) are this module's, under
    ``stacked_params`` / ``stacked_buffers`` (dots spelled ``__``), and the step is
    ``functional_call`` of one layer. ``forward(ids, *layer_tensors)`` takes the tensors of
    ``real.layer_inputs`` (``layer_tensors(real)``): the step closes over them."""

    def __init__(self, real: RealModel) -> None:
        super().__init__()
        self.real = dataclasses.replace(real, model=copy.deepcopy(real.model))
        layers = self.real.layers
        params, buffers = torch.func.stack_module_state(layers)
        self.stacked_params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in params.items()})
        self.stacked_buffers = torch.nn.Module()
        for key, value in buffers.items():
            self.stacked_buffers.register_buffer(key.replace(".", "__"), value)
        # One layer as the step's module: its own parameters are replaced on every call.
        object.__setattr__(self, "template", layers[0])
        parent_path, _, attr = self.real.layers_path.rpartition(".")
        parent = _container(self.real.model, parent_path) if parent_path else self.real.model
        setattr(parent, attr, type(getattr(parent, attr))())  # the loop's layers are gone
        self.model = self.real.model
        self._treespec = pytree.tree_flatten(real.layer_inputs)[1]
        # Each leaf of the layer inputs: a tensor (taken from forward's arguments) or a constant.
        self._is_tensor = [isinstance(v, torch.Tensor) for v in pytree.tree_leaves(real.layer_inputs)]
        self._constants = [None if t else v for t, v in zip(self._is_tensor, pytree.tree_leaves(real.layer_inputs))]

    def forward(self, ids: torch.Tensor, *layer_tensors: torch.Tensor) -> torch.Tensor:
        tensors = iter(layer_tensors)
        leaves = [next(tensors) if t else c for t, c in zip(self._is_tensor, self._constants)]
        args, kwargs = pytree.tree_unflatten(leaves, self._treespec)
        params = {k.replace("__", "."): v for k, v in self.stacked_params.items()}
        buffers = {k.replace("__", "."): v for k, v in self.stacked_buffers.named_buffers()}
        template = self.template

        def step(h, layer):
            return torch.func.functional_call(template, layer, (h, *args), kwargs), None

        h, _ = hops.scan(step, self.real.embed(self.model, ids), (params, buffers))
        return self.real.head(self.model, h)

    def grads_by_plain_name(self) -> dict[str, torch.Tensor | None]:
        """Each gradient under the plain model's parameter names (layer ``i``'s parameters
        are slices of the stacked ones)."""
        grads = {name: p.grad for name, p in self.model.named_parameters()}
        for key, stacked in self.stacked_params.items():
            for i in range(stacked.shape[0]):
                grads[f"{self.real.layers_path}.{i}.{key.replace('__', '.')}"] = None if stacked.grad is None else stacked.grad[i]
        return grads


class Logits(torch.nn.Module):
    """``real``'s model as a module whose ``forward(ids)`` returns the logits (its parameters
    under ``model.``), for ``functional_call`` and tracers."""

    def __init__(self, real: RealModel) -> None:
        super().__init__()
        self.model = real.model
        object.__setattr__(self, "_forward", real.forward)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(self.model, ids)


def layer_tensors(real: RealModel) -> list[torch.Tensor]:
    """The tensors among ``real.layer_inputs``, in ``ScannedDecoder.forward``'s order."""
    return [v for v in pytree.tree_leaves(real.layer_inputs) if isinstance(v, torch.Tensor)]


def plain_grads(real: RealModel, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The plain model's loss and the gradient of every parameter, by name."""
    real.model.zero_grad(set_to_none=True)
    loss = loss_of(real.logits(ids), targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in real.model.named_parameters()}


# --------------------------------------------------------------------------- attention as a region


def region_attention(real: RealModel) -> RealModel:
    """``real`` (a copy) whose attention core (scores, softmax, values) is a ``hops.local_map``
    region on the 2x2 mesh: each device the batch rows it holds ("data") and the heads it holds
    ("model"). HF models through their public ``AttentionInterface``; torchtitan by replacing
    each layer's ``inner_attention`` module."""
    region = dataclasses.replace(real, model=copy.deepcopy(real.model), name=f"{real.name}_region")
    if real.name.startswith("hf_"):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        original = real.model.config._attn_implementation
        name = f"hops_region_{original}"
        AttentionInterface.register(name, _hf_region_attention(original))
        # The mask the model builds for the new name: the one the original attention takes.
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
        region.model.set_attn_implementation(name)
    else:
        for layer in region.layers:
            layer.attention.inner_attention = RegionInnerAttention(layer.attention.inner_attention)
    return record_layer_inputs(region, example_ids()[0])


def _hf_region_attention(original: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if original == "eager":
            inner = sys.modules[type(module).__module__].eager_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS[original]

        def body(q, k, v, *mask):
            return inner(module, q, k, v, mask[0] if mask else None, **kwargs)[0]

        # [batch, seq, heads, head_dim] out; the mask [batch, 1, seq, seq] by batch rows.
        out = (Shard(0), Shard(2))
        tensors = (query, key, value) if attention_mask is None else (query, key, value, attention_mask)
        placements = (HEADS_SHARDED,) * 3 + ((Shard(0), hops.Replicate()),) * (attention_mask is not None)
        return hops.local_map(body, out_placements=out, in_placements=placements, mesh=MESH)(*tensors), None

    return attention


class RegionInnerAttention(torch.nn.Module):
    """torchtitan's ``inner_attention`` (q, k, v as [batch, heads, seq, head_dim]) run as a
    ``hops.local_map`` region, the batch over "data" and the heads over "model"."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        inner = self.inner

        def body(q, k, v):
            return inner(q, k, v, **kwargs)

        return hops.local_map(body, out_placements=HEADS_SHARDED, in_placements=(HEADS_SHARDED,) * 3, mesh=MESH)(q, k, v)
