"""An SAE (or a transcoder) measured on held-out activations and in the model's forward.

- explained variance: 1 − Σ‖x − x̂‖² / Σ‖x − mean(x)‖² over every held-out token (mean over those tokens)
- mean L0: active latents per token
- dead fraction: latents active on no held-out token
- CE loss recovered: (CE_zero − CE_sae) / (CE_zero − CE_orig), next-token cross-entropy over the held-out
  sequences' real positions, with the site's activation replaced by the SAE's reconstruction (CE_sae) or
  by zeros (CE_zero) at every position but the first (position 0 keeps its own, as in training).

A transcoder is measured on what it writes: its source rows hold its input and the output site's value side
by side ([n, d_in + d_out]), the explained variance is the output's (x above the output site's value, x̂
the transcoder's output), L0 and dead latents its latents' on the input; in the forward its output replaces
the output site's value (CE_zero: that value zeroed; for an MLP transcoder, the MLP's output).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from ...features.sae import Sae
from ...features.sites import Site, at_site
from .activations import as_positions, batches_of, kept_positions, padded


@torch.inference_mode()
def reconstruction_metrics(sae: Sae, source: Iterable[torch.Tensor]) -> dict:
    """source: [n, d_in] batches (a transcoder: [n, d_in + d_out], input then output) -> explained_variance,
    mean_l0, dead_fraction, tokens."""
    sse = 0.0
    sum_x = None
    sum_sq = 0.0
    l0 = 0.0
    n = 0
    fired = torch.zeros(sae.cfg.d_sae, dtype=torch.bool)
    for rows in source:
        x = rows.float()
        if sae.cfg.transcoder:
            x, rows = x[:, : sae.cfg.d_in], x[:, sae.cfg.d_in :]
            acts, recon = sae.encode(x), sae.forward(x)
            x = rows  # what is measured: the output
        else:
            acts, norm = sae.encode_with_norm(x)
            recon = sae.decode(acts, norm)
        sse += float(((x - recon) ** 2).sum(dtype=torch.float64))
        sum_x = x.sum(0, dtype=torch.float64) if sum_x is None else sum_x + x.sum(0, dtype=torch.float64)
        sum_sq += float((x.double() ** 2).sum())
        active = acts > 0
        l0 += float(active.sum())
        fired |= active.any(0)
        n += len(x)
    if n == 0:
        return {"tokens": 0, "explained_variance": None, "mean_l0": None, "dead_fraction": None}
    total = sum_sq - float((sum_x**2).sum()) / n
    return {
        "tokens": n,
        "explained_variance": 1.0 - sse / total if total > 0 else None,
        "mean_l0": l0 / n,
        "dead_fraction": 1.0 - float(fired.float().mean()),
    }


@torch.inference_mode()
def ce_loss_recovered(
    model,
    adapter,
    sae: Sae,
    site: Site,
    sequences: list[list[int]],
    *,
    pad_id: int,
    batch_tokens: int = 2048,
    site_out: Site | None = None,
) -> dict:
    """Mean next-token cross-entropy (nats) of the original forward, with the SAE spliced in at `site`,
    and with the site zeroed; and the loss recovered. A transcoder reads `site` and writes `site_out`: its
    output replaces that site's value (zeroed for CE_zero)."""
    device = next(model.parameters()).device
    sums = {"orig": 0.0, "sae": 0.0, "zero": 0.0}
    count = 0
    for group in batches_of(sequences, batch_tokens):
        ids, mask = padded(group, pad_id, device)
        b, t = ids.shape
        keep = kept_positions(mask)
        read: list[torch.Tensor] = []

        def grab(tensor):  # a transcoder's input, read on the way to its output site
            read[:] = [as_positions(tensor, b, t)[keep].float()]  # noqa: B023

        def splice(tensor, how):  # a hook used only by this iteration's forwards
            view = as_positions(tensor, b, t)  # noqa: B023
            out = view.clone()
            if how == "zero":
                out[keep] = 0  # noqa: B023
            elif site_out is not None:
                out[keep] = sae.forward(read[0]).to(view.dtype)  # noqa: B023
            else:
                out[keep] = sae.reconstruct(view[keep].float()).to(view.dtype)  # noqa: B023
            return out.view(tensor.shape)

        targets = ids[:, 1:]
        valid = mask[:, 1:].bool()
        for how in sums:
            with contextlib.ExitStack() as hooks:
                if how != "orig" and site_out is not None:
                    hooks.enter_context(at_site(adapter, site, grab))
                if how != "orig":
                    hooks.enter_context(at_site(adapter, site_out or site, lambda tensor, how=how: splice(tensor, how)))
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            sums[how] += float(nll[valid].sum())
        count += int(valid.sum())
    if count == 0:
        return {"ce_orig": None, "ce_sae": None, "ce_zero": None, "loss_recovered": None, "tokens": 0}
    ce = {k: v / count for k, v in sums.items()}
    gap = ce["zero"] - ce["orig"]
    return {
        "ce_orig": ce["orig"],
        "ce_sae": ce["sae"],
        "ce_zero": ce["zero"],
        "tokens": count,
        "loss_recovered": (ce["zero"] - ce["sae"]) / gap if gap != 0 else None,
    }
