"""A tiny random Llama as wide as a 7B model's attention: 32 layers × 32 query heads (8 KV heads),
hidden size 64 (head size 2), the embedded model's tokenizer, weights drawn large enough that
attention is peaked; built from a transformers config, no
download."""

from __future__ import annotations

from pathlib import Path

LAYERS, HEADS = 32, 32


def wide_llama(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    tok = load_model(ModelSpec()).tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=8,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger random weights: peaked attention, so the heads differ and get labels
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 if "embed" not in name else 1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
