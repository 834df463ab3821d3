"""Mean values for `mode: mean` ablations: a component's mean over every position of the parent's final
sequences, each run alone through the unedited model."""

from __future__ import annotations

import torch

from ..component_hooks import first, read_component
from .entries import AblateHead, Ablation

MEAN_COMPONENT = {
    "ablate_head": "head",
    "ablate_attention": "attn",
    "ablate_mlp": "mlp",
    "ablate_neurons": "ffn",
    "ablate_layer": "layer",
}


@torch.inference_mode()
def component_means(
    adapter, sequences: list[list[int]], wanted: set[tuple[str, int]]
) -> dict[tuple[str, int], torch.Tensor]:
    """Mean of each wanted (component, layer) over every token position of every sequence.

    Each sequence (a parent's prompt + generated ids) runs alone in one forward of the unedited model,
    so there is no padding. Components: head (the output projection's input, all heads; slice it),
    attn (attention block output), mlp (MLP block output), ffn (the down projection's input: every
    neuron), layer (the block's residual contribution: output - input). Sums are float64.
    """
    model = adapter.model
    sums: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[tuple[str, int], int] = {}

    def add(key, x):
        x = x.reshape(-1, x.shape[-1]).double()
        sums[key] = sums[key] + x.sum(0) if key in sums else x.sum(0)
        counts[key] = counts.get(key, 0) + x.shape[0]

    handles = []
    try:
        for kind, layer in sorted(wanted):
            key = (kind, layer)
            if kind in ("head", "attn", "mlp", "ffn"):
                handles.append(read_component(adapter, kind, layer, lambda x, key=key: add(key, x)))
            elif kind == "layer":  # the block's contribution: its output minus its input
                saved = {}
                block = adapter.layers[layer]
                handles.append(
                    block.register_forward_pre_hook(
                        lambda m, a, k, saved=saved: saved.__setitem__("x", a[0] if a else k["hidden_states"]),
                        with_kwargs=True,
                    )
                )
                handles.append(
                    block.register_forward_hook(lambda m, a, o, key=key, saved=saved: add(key, first(o) - saved["x"]))
                )
        device = next(model.parameters()).device
        for ids in sequences:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {key: (sums[key] / counts[key]) for key in sums}


def mean_ablation_values(entries: list, adapter, sequences, note=None) -> dict[int, torch.Tensor]:
    """For each mean-ablation entry (by index): the value it puts in place of its component, the
    component's mean over `sequences()` (`component_means`; a head's own slice for ablate_head).

    `sequences` is called only when some entry needs a mean; `note(text)` is told before the forwards."""
    wanted = {(MEAN_COMPONENT[e.kind], e.layer) for e in entries if isinstance(e, Ablation) and e.mode == "mean"}
    if not wanted:
        return {}
    seqs = sequences()
    if note is not None:
        note(f"mean values: one forward over each of the parent's {len(seqs)} sequences")
    means = component_means(adapter, seqs, wanted)
    out = {}
    for i, e in enumerate(entries):
        if isinstance(e, Ablation) and e.mode == "mean":
            mean = means[(MEAN_COMPONENT[e.kind], e.layer)]
            if isinstance(e, AblateHead):
                mean = mean[e.head * adapter.head_dim : (e.head + 1) * adapter.head_dim]
            out[i] = mean
    return out
