"""Architecture adapters: one standard vocabulary over the module trees of decoder families.

Standard names (used by probes, interventions and the archive):
  layers[i]        decoder block i             output: residual stream after block i   [batch, pos, d_model]
  attn(i)          attention module of block i  output[0]: attention output (after o_proj) [batch, pos, d_model]
  o_proj(i)        output projection            input: concatenated head outputs        [batch, pos, heads*head_dim]
  mlp(i)           MLP block                    output: MLP output                      [batch, pos, d_model]
  mlp_down(i)      MLP output projection        input: intermediate activation          [batch, pos, d_ffn]
                   (act(gate)*up for gated MLPs, act(fc_in) for plain ones)
  final_norm       norm applied before the unembedding
  unembed          weight [vocab, d_model] (+ optional bias), final logit soft-capping if any

An unknown family fails before generation with the model class and the supported families.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import UnsupportedArchitectureError


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    base: str  # path from the CausalLM to the decoder stack
    layers: str  # path from base to the ModuleList of blocks
    attn: str  # paths from a block
    o_proj: str
    mlp: str
    mlp_down: str
    final_norm: str  # path from base
    unembed: str  # path from the CausalLM
    gated_mlp: bool = True
    parallel_residual: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "granite"),
           "model", "layers", "self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj", "norm", "lm_head"),
    Family("gemma", ("gemma", "gemma2", "gemma3_text"),
           "model", "layers", "self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj", "norm", "lm_head"),
    Family("phi3", ("phi3",),
           "model", "layers", "self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj", "norm", "lm_head"),
    Family("phi", ("phi",),
           "model", "layers", "self_attn", "self_attn.dense", "mlp", "mlp.fc2", "final_layernorm", "lm_head",
           gated_mlp=False, parallel_residual=True),
    Family("gpt2", ("gpt2",),
           "transformer", "h", "attn", "attn.c_proj", "mlp", "mlp.c_proj", "ln_f", "lm_head", gated_mlp=False),
    Family("gpt_neox", ("gpt_neox",),
           "gpt_neox", "layers", "attention", "attention.dense", "mlp", "mlp.dense_4h_to_h", "final_layer_norm",
           "embed_out", gated_mlp=False, parallel_residual=True),
)


def supported_families() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)


class Adapter:
    """Binds a Family to one loaded model and answers standard-name questions about it."""

    def __init__(self, model: torch.nn.Module, family: Family):
        self.model = model
        self.family = family
        self.config = model.config
        text_cfg = getattr(model.config, "text_config", None) or model.config
        self.n_layers: int = text_cfg.num_hidden_layers
        self.n_heads: int = text_cfg.num_attention_heads
        self.n_kv_heads: int = getattr(text_cfg, "num_key_value_heads", None) or self.n_heads
        self.d_model: int = text_cfg.hidden_size
        self.head_dim: int = getattr(text_cfg, "head_dim", None) or self.d_model // self.n_heads
        self.vocab_size: int = text_cfg.vocab_size
        self.final_softcap: float | None = getattr(text_cfg, "final_logit_softcapping", None)
        self.base = _get(model, family.base)
        self.layers = list(_get(self.base, family.layers))
        if len(self.layers) != self.n_layers:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__}: config says {self.n_layers} layers but found {len(self.layers)} blocks"
            )
        self._attn_index = {id(self.attn(i)): i for i in range(self.n_layers)}
        self.d_ffn: int = self._ffn_size()

    # --- modules ---------------------------------------------------------------------------
    def attn(self, i: int) -> torch.nn.Module:
        return _get(self.layers[i], self.family.attn)

    def o_proj(self, i: int) -> torch.nn.Module:
        return _get(self.layers[i], self.family.o_proj)

    def mlp(self, i: int) -> torch.nn.Module:
        return _get(self.layers[i], self.family.mlp)

    def mlp_down(self, i: int) -> torch.nn.Module:
        return _get(self.layers[i], self.family.mlp_down)

    @property
    def final_norm(self) -> torch.nn.Module:
        return _get(self.base, self.family.final_norm)

    @property
    def unembed(self) -> torch.nn.Module:
        return _get(self.model, self.family.unembed)

    def layer_of_attention(self, module: torch.nn.Module) -> int:
        return self._attn_index[id(module)]

    def kv_head_of_head(self) -> list[int]:
        """Which KV head each query head reads (GQA/MQA: consecutive groups, as `repeat_kv` does)."""
        group = self.n_heads // self.n_kv_heads
        return [h // group for h in range(self.n_heads)]

    def eager_attention(self) -> Callable:
        """The model's own eager attention function (handles its soft-capping, sinks, dropout)."""
        module = sys.modules[type(self.attn(0)).__module__]
        fn = getattr(module, "eager_attention_forward", None)
        if fn is None:
            raise UnsupportedArchitectureError(
                f"{type(self.model).__name__}: no eager_attention_forward in {module.__name__}; attention capture unsupported"
            )
        return fn

    def _ffn_size(self) -> int:
        down = self.mlp_down(0)
        if hasattr(down, "in_features"):
            return down.in_features
        weight = down.weight  # GPT-2's Conv1D stores [in, out]
        return weight.shape[0]

    def unembed_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., d_model] normed residual -> [..., vocab] logits, with final soft-capping if the model has it."""
        head = self.unembed
        logits = torch.nn.functional.linear(normed, head.weight, getattr(head, "bias", None))
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def adapter_for(model: torch.nn.Module) -> Adapter:
    model_type = getattr(model.config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            try:
                return Adapter(model, family)
            except AttributeError as err:
                raise UnsupportedArchitectureError(
                    f"{type(model).__name__} (model_type={model_type}) does not have the modules the {family.name} "
                    f"adapter expects ({err}); supported families: {supported_families()}"
                ) from None
    raise UnsupportedArchitectureError(
        f"unsupported architecture {type(model).__name__} (model_type={model_type!r}); "
        f"supported families: {supported_families()}"
    )
