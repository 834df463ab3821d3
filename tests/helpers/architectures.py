"""The architecture tests' own table of decoder families: how to build each tiny model from its
transformers config class, and where the reference hooks go; the model's own eager forward with those
hooks (FullForward), and a final norm as the linear map it is at a given input (frozen_norm)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


# ---------------------------------------------------------------------------------------------
# The test's own table: how to build each tiny model and where the reference hooks go.
@dataclass
class Case:
    id: str
    family: str  # the lmtrace family the model must be mapped to
    config: Callable[[dict], object]  # common kwargs (vocab, special ids) -> transformers config
    example: str  # human-readable example config (for the support table)
    layers: str = "model.layers"  # CausalLM -> ModuleList of blocks
    attn: str = "self_attn"  # block -> attention module (output[0] = attention output)
    o_proj: str = "self_attn.o_proj"  # block -> output projection (input = concatenated head outputs)
    mlp_out: str = "mlp"  # block -> module whose output is the MLP output
    ffn_in: str | None = "mlp.down_proj"  # block -> module whose input is the FFN activation
    final: tuple[str, ...] = ("model.norm",)  # CausalLM -> modules between last residual and lm_head
    router: str | None = None  # block -> MoE router module (output[0] = router logits)
    route: str | None = None  # how the router turns logits into (experts, weights)
    sliding: bool = False  # the model has sliding-window layers shorter than the sequences
    sinks: bool = False


D = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256)


def hf_config(name: str, **kw):
    """A Case's `config`: transformers' config class `name` with these kwargs and the common ones."""
    import transformers

    return lambda common: getattr(transformers, name)(**{**kw, **common})


GPT2 = dict(layers="transformer.h", attn="attn", o_proj="attn.c_proj", ffn_in="mlp.c_proj", final=("transformer.ln_f",))
NEOX = dict(
    layers="gpt_neox.layers",
    attn="attention",
    o_proj="attention.dense",
    ffn_in="mlp.dense_4h_to_h",
    final=("gpt_neox.final_layer_norm",),
)
PHI = dict(o_proj="self_attn.dense", ffn_in="mlp.fc2", final=("model.final_layernorm",))
OPT = dict(
    layers="model.decoder.layers",
    o_proj="self_attn.out_proj",
    mlp_out="fc2",
    ffn_in="fc2",
    final=("model.decoder.final_layer_norm", "model.decoder.project_out"),
)

CASES = [
    Case(
        "llama",
        "llama",
        hf_config("LlamaConfig", **D, num_key_value_heads=2),
        "LlamaConfig: 3 layers, 4 heads / 2 KV heads (GQA)",
    ),
    Case(
        "mistral",
        "llama",
        hf_config("MistralConfig", **D, num_key_value_heads=2, sliding_window=5),
        "MistralConfig: GQA 4/2, sliding_window=5",
        sliding=True,
    ),
    Case("qwen2", "llama", hf_config("Qwen2Config", **D, num_key_value_heads=2), "Qwen2Config: GQA 4/2, q/k/v biases"),
    Case(
        "qwen3",
        "llama",
        hf_config("Qwen3Config", **D, num_key_value_heads=2, head_dim=16),
        "Qwen3Config: GQA 4/2, q/k RMS norms",
    ),
    Case(
        "smollm3",
        "llama",
        hf_config("SmolLM3Config", **D, num_key_value_heads=2),
        "SmolLM3Config: GQA 4/2, NoPE every 4th layer",
    ),
    Case("olmo2", "llama", hf_config("Olmo2Config", **D, num_key_value_heads=2), "Olmo2Config: post-norms, q/k norms"),
    Case(
        "gemma",
        "gemma",
        hf_config("GemmaConfig", **D, num_key_value_heads=1, head_dim=16),
        "GemmaConfig: multi-query (1 KV head), scaled embeddings",
    ),
    Case(
        "gemma2",
        "gemma",
        hf_config("Gemma2Config", **D, num_key_value_heads=2, head_dim=16, sliding_window=4),
        "Gemma2Config: GQA 4/2, sliding_window=4 on alternate layers, attn softcap 50, final softcap 30",
        sliding=True,
    ),
    Case(
        "gemma3",
        "gemma",
        hf_config(
            "Gemma3TextConfig", **D, num_key_value_heads=1, head_dim=16, sliding_window=4, sliding_window_pattern=2
        ),
        "Gemma3TextConfig: MQA, sliding_window=4 on alternate layers, q/k norms, query_pre_attn_scalar",
        sliding=True,
    ),
    Case(
        "gpt2",
        "gpt2",
        hf_config("GPT2Config", n_embd=64, n_layer=3, n_head=4, n_positions=256),
        "GPT2Config: 3 layers, 4 heads, fused c_attn, Conv1D",
        **GPT2,
    ),
    Case(
        "gpt_neox",
        "gpt_neox",
        hf_config("GPTNeoXConfig", **D),
        "GPTNeoXConfig: fused query_key_value, parallel residual, rotary_pct 0.25",
        **NEOX,
    ),
    Case(
        "phi", "phi", hf_config("PhiConfig", **D), "PhiConfig: parallel residual, partial rotary, lm_head bias", **PHI
    ),
    Case(
        "phi3",
        "phi3",
        hf_config("Phi3Config", **D, num_key_value_heads=2),
        "Phi3Config: fused qkv_proj and gate_up_proj, GQA 4/2",
    ),
    Case(
        "opt",
        "opt",
        hf_config(
            "OPTConfig",
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=256,
        ),
        "OPTConfig: pre-LN (OPT-125m style), learned positions, ReLU fc1/fc2 on the block",
        **OPT,
    ),
    Case(
        "opt_postln",
        "opt",
        hf_config(
            "OPTConfig",
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
            max_position_embeddings=256,
        ),
        "OPTConfig: post-LN with project_in/project_out (OPT-350m style)",
        **OPT,
    ),
    Case(
        "mixtral",
        "moe",
        hf_config("MixtralConfig", **D, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "MixtralConfig: 4 experts, top-2, GQA 4/2",
        ffn_in=None,
        router="mlp.gate",
        route="softmax_topk_renorm",
    ),
    Case(
        "qwen2_moe",
        "moe",
        hf_config(
            "Qwen2MoeConfig",
            **D,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
        ),
        "Qwen2MoeConfig: 4 experts, top-2, shared expert, layer 1 dense",
        ffn_in=None,
        router="mlp.gate",
        route="softmax_topk",
    ),
    Case(
        "gpt_oss",
        "moe",
        hf_config(
            "GptOssConfig",
            **D,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        ),
        "GptOssConfig: 4 experts, top-2, attention sinks, sliding_window=4 on alternate layers",
        ffn_in=None,
        router="mlp.router",
        route="topk_softmax",
        sliding=True,
        sinks=True,
    ),
]
BY_ID = {c.id: c for c in CASES}


def attr_path(obj, path):
    """obj's attribute at a dotted path (`model.layers`)."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def build_tiny(case: Case, tokenizer, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(case.config(common))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class FullForward:
    """The model's own eager forward over one final sequence, float32 unless told otherwise, with hooks
    placed from the test's own `Case` table."""

    def __init__(self, model_ref: str, case: Case, dtype: str = "float32"):
        from lmtrace.runner.models import load_model
        from lmtrace.spec.run_spec import ModelSpec

        self.case = case
        self.model = load_model(ModelSpec(ref=model_ref, attn_implementation="eager", dtype=dtype)).model
        self.blocks = list(attr_path(self.model, case.layers))

    @torch.inference_mode()
    def run(self, ids: list[int]) -> dict:
        c, model = self.case, self.model
        rec: dict[str, dict] = {k: {} for k in ("block", "attn", "mlp", "ffn", "o_in", "router")}
        hooks = []

        def keep(store, i, what):
            def hook(m, args, out=None):
                t = {"out": out, "in": args[0] if args else None}[what]
                if isinstance(t, tuple):
                    t = t[0]
                rec[store][i] = t.reshape(len(ids), t.shape[-1]) if t.dim() == 2 else t[0]

            return hook

        for i, b in enumerate(self.blocks):
            hooks.append(b.register_forward_hook(keep("block", i, "out")))
            hooks.append(attr_path(b, c.attn).register_forward_hook(keep("attn", i, "out")))
            hooks.append(attr_path(b, c.mlp_out).register_forward_hook(keep("mlp", i, "out")))
            hooks.append(attr_path(b, c.o_proj).register_forward_pre_hook(keep("o_in", i, "in")))
            if c.ffn_in:
                hooks.append(attr_path(b, c.ffn_in).register_forward_pre_hook(keep("ffn", i, "in")))
            if c.router:
                try:
                    router = attr_path(b, c.router)
                except AttributeError:
                    router = None
                if router is not None and hasattr(router, "top_k"):

                    def rhook(m, a, out, i=i):
                        rec["router"][i] = (out[0].float(), m.top_k)

                    hooks.append(router.register_forward_hook(rhook))
        try:
            out = model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
        finally:
            for h in hooks:
                h.remove()
        L = len(self.blocks)
        hs = [h[0].float() for h in out.hidden_states]
        resid = [rec["block"][i].float() for i in range(L)]
        # hidden_states[l + 1] is block l's output, except the last one, which is returned final-normed
        for i in range(L - 1):
            torch.testing.assert_close(hs[i + 1], resid[i], atol=1e-5, rtol=1e-5)
        return {
            "logits": out.logits[0].float(),
            "attn": [a[0].float() for a in out.attentions],  # [H, T, T]
            "embed": hs[0],
            "resid": resid,
            "attn_out": [rec["attn"][i].float() for i in range(L)],
            "mlp_out": [rec["mlp"][i].float() for i in range(L)],
            "o_in": [rec["o_in"][i].float() for i in range(L)],  # [T, H*D]
            "ffn": [rec["ffn"][i].float() for i in range(L)] if c.ffn_in else None,
            "router": rec["router"],
        }

    def lens_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This layer's residual through the model's own final modules and lm_head (+ final soft-capping)."""
        x = h.to(self.model.lm_head.weight.dtype)
        for path in self.case.final:
            m = attr_path(self.model, path)
            if m is not None:
                x = m(x)
        logits = self.model.lm_head(x).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def through_final(self, x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        """parts [..., d] of the final residual x [d] -> their images in the unembedding's input space:
        the final norm (where the model has one) as the linear map it is with its scale fixed at x, then
        the linear maps after it (OPT's project_out) without their bias, a constant term."""
        mods = [m for m in (attr_path(self.model, p) for p in self.case.final) if m is not None]
        if mods and not isinstance(mods[0], torch.nn.Linear):
            parts = frozen_norm(mods[0], x, parts)
            mods = mods[1:]
        for m in mods:
            parts = parts @ m.weight.float().T
        return parts

    def margin_share(self, x: torch.Tensor, part: torch.Tensor, a: int, b: int) -> tuple[float, float]:
        """A part [d] of the final residual x [d] -> its share of logit(a) − logit(b) (before any final
        soft-capping), and that dot product's own scale |image| |W_a − W_b| (for a tolerance)."""
        W = self.model.lm_head.weight.float()
        image, d = self.through_final(x, part), W[a] - W[b]
        return (image @ d).item(), (image.norm() * d.norm()).item()


def frozen_norm(norm: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """A LayerNorm/RMSNorm as the linear map it is with its scale fixed at the actual input x [d]: c [..., d]
    -> its image (without the LayerNorm's bias, a constant term). Gemma's RMSNorms scale by 1 + weight."""
    if isinstance(norm, torch.nn.LayerNorm):
        xc = x - x.mean()
        sigma = torch.sqrt((xc * xc).mean() + norm.eps)
        c = c - c.mean(-1, keepdim=True)
        return c / sigma * (norm.weight.float() if norm.weight is not None else 1.0)
    weight = norm.weight.float()
    if "Gemma" in type(norm).__name__:
        weight = 1.0 + weight
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return c / torch.sqrt((x.float() ** 2).mean() + eps) * weight
