"""lmtrace's stacked KV cache gives the model exactly what transformers' DynamicCache gives it.

Reference: the same greedy loop (left-padded batch, explicit mask and positions, as the tracer runs
it) with transformers' own `DynamicCache`. Logits must be equal bit for bit at every step, with the
whole run allocated up front and with a stack that has to grow several times on the way.
"""

from __future__ import annotations

import pytest
import torch

from lmtrace.capture.kv_cache import StackedCache, StackedLayer

D = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama-gqa": lambda t: t.LlamaConfig(**D, num_key_value_heads=2),
    "gemma2-sliding": lambda t: t.Gemma2Config(**D, num_key_value_heads=2, head_dim=8, sliding_window=4),
    "gpt2": lambda t: t.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=128),
    "gpt_neox": lambda t: t.GPTNeoXConfig(**D),
}


def _model(name: str):
    import transformers

    torch.manual_seed(0)
    kernel = "eager" if name.startswith("gemma2") else "sdpa"  # Gemma2 refuses sdpa (soft-capping)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](transformers), attn_implementation=kernel)
    return model.eval()


@torch.inference_mode()
def _greedy_logits(model, cache, steps: int = 12) -> list[torch.Tensor]:
    prompts = [[5, 17, 3, 44, 9, 21, 8], [30, 2, 11]]  # left padded to 7
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = []
    for _ in range(steps):
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        out.append(logits)
        ids = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(ids)], 1)
        positions = positions[:, -1:] + 1
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("hint", [0, 64], ids=["growing", "preallocated"])
def test_logits_equal_dynamic_cache_bit_for_bit(name, hint):
    from transformers import DynamicCache

    model = _model(name)
    reference = _greedy_logits(model, DynamicCache(config=model.config))
    cache = StackedCache(model.config, capacity_hint=hint)
    got = _greedy_logits(model, cache)
    for step, (a, b) in enumerate(zip(got, reference)):
        assert torch.equal(a, b), f"{name}: step {step} logits differ by {(a - b).abs().max().item():.3g}"
    stacked = [i for i, layer in enumerate(cache.layers) if isinstance(layer, StackedLayer) and layer.stacked]
    sliding = [i for i, t in enumerate(getattr(model.config, "layer_types", None) or []) if t != "full_attention"]
    assert stacked == [i for i in range(model.config.num_hidden_layers) if i not in sliding]
    if hint == 0:  # 7 prompt positions, grown by half each time it fills: several reallocations
        assert cache.stack.stacks[0].capacity >= 7 + 11 and cache.stack.stacks[0].length[stacked[0]] == 7 + 11


def test_kernel_keys_are_views_of_the_stack():
    """What the attention kernel receives is the stack's view, so the rows can be computed from it."""
    model = _model("llama-gqa")
    cache = StackedCache(model.config, capacity_hint=32)
    _greedy_logits(model, cache, steps=3)
    for i, layer in enumerate(cache.layers):
        assert cache.stack.holds(i, layer.keys)
        assert not cache.stack.holds(i, layer.keys.clone())
        assert not cache.stack.holds((i + 1) % len(cache.layers), layer.keys)
    assert torch.equal(cache.stack.stacks[0].keys_of([0, 2], 9)[1], cache.layers[2].keys)


def test_beam_reordering_is_refused():
    model = _model("llama-gqa")
    cache = StackedCache(model.config)
    _greedy_logits(model, cache, steps=1)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.batch_select_indices(torch.tensor([1, 0]))


def test_llama_rows_come_from_one_product_over_the_stack(tmp_path, tiny_llama_dir, monkeypatch):
    """On a Llama every captured layer's row comes from the batched product (the per-layer fallback is
    for sliding windows): otherwise the rows stay right (other tests) but cost ~3 ms more a step."""
    from lmtrace.capture.attention_rows import BatchedRows
    from tests.helpers.runs import PROMPTS, run_spec

    served: list[list[int]] = []
    rows = BatchedRows.rows

    def counting(self, device=None):
        layers, probs, T = rows(self, device)
        served.append(layers)
        return layers, probs, T

    monkeypatch.setattr(BatchedRows, "rows", counting)
    run = run_spec(
        tmp_path,
        {
            "model": {"ref": str(tiny_llama_dir)},
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 5, "batch_size": 3},
        },
    )
    assert run.manifest["status"] == "complete"
    assert served and all(layers == [0, 1, 2, 3] for layers in served), served
    assert len(served) == 5
