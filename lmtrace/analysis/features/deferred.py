"""The deferred feature activations of a complete run (`lmtrace features RUN --sae DIR`): each generated
token's top-k latents of an SAE, as `generate` with `capture.features` would have archived them.

Two sources, the same values (up to float rounding):
  archive  the run's archived residual vectors (`resid`) when the SAE reads a residual layer the run
           holds (resid_post L, or resid_pre L+1): no model, one encode per block of sequences;
  replay   every sequence (prompt + generated tokens) run once through the run's model, stopped at the
           SAE's site; step s reads position prompt_len − 1 + s, the query position of step s.
Both write whole groups of sequences (`write(seqs, ids, vals, prompt)`, ids/vals [n, steps, k_feat]),
steps past a sequence's end left at the fill (-1 / NaN), as generate leaves them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...capture.feature_probe import top_features
from ...features.sites import Site, at_site
from .activations import as_positions, padded

Write = Callable[[slice, np.ndarray, np.ndarray, bool], None]


def _groups(n: int, size: int):
    for s0 in range(0, n, size):
        yield slice(s0, min(n, s0 + size))


@torch.inference_mode()
def from_archive(run, sae, resid_index: int, top_k: int, width: int, group: int, write: Write) -> int:
    """Encode the archived `resid` at `resid_index`; returns the tokens encoded. The residual is read a
    block of sequences at a time by lmtrace's own shard reader (`archive/feature_arrays.read_block`),
    that layer only laid out (each inner chunk, every layer of a sequence's block of steps, is still
    decoded and its checksum checked)."""
    from ...archive.feature_arrays import read_block

    resid = run.array("resid")
    lengths = run.generated_len()
    n_seq, n_steps = resid.shape[:2]
    tokens = 0
    for seqs in _groups(n_seq, group):
        block = read_block(resid, seqs.start, seqs.stop, pick=(2, resid_index))  # [n, steps, d]
        x = torch.from_numpy(np.asarray(block, dtype=np.float32))  # [n, steps, d]
        ids, vals = top_features(sae, x, top_k, width)
        ids, vals = ids.numpy(), vals.numpy()
        past = np.arange(n_steps)[None, :] >= np.maximum(lengths[seqs], 0)[:, None]
        ids[past], vals[past] = -1, np.nan
        tokens += int((~past).sum())
        write(seqs, ids, vals, False)
    return tokens


class _Stop(Exception):
    """Raised at the site: the layers above it are not needed."""


@torch.inference_mode()
def from_replay(
    model,
    adapter,
    site: Site,
    sae,
    sequences: list[tuple[list[int], list[int]]],
    *,
    top_k: int,
    width: int,
    n_steps: int,
    max_prompt: int,
    prompt: bool,
    group: int,
    pad_id: int,
    write: Write,
) -> int:
    """Replay (prompt ids, generated ids) of every sequence, `group` sequences at a time; returns the
    tokens encoded."""
    device = next(model.parameters()).device
    if sae.W_enc.device != device:
        sae.to(device)
    tokens = 0
    for seqs in _groups(len(sequences), group):
        rows = sequences[seqs]
        ids_in, mask = padded([p + g for p, g in rows], pad_id, device)
        seen: list[torch.Tensor] = []

        def grab(tensor, b=ids_in.shape[0], t=ids_in.shape[1], seen=seen):
            seen.append(as_positions(tensor, b, t))
            raise _Stop

        try:
            with at_site(adapter, site, grab):
                model(input_ids=ids_in, attention_mask=mask, use_cache=False)
        except _Stop:
            pass
        ids_all, vals_all = (t.cpu().numpy() for t in top_features(sae, seen[0], top_k, width))  # [n, T, width]
        ids = np.full((len(rows), n_steps, width), -1, dtype=np.int32)
        vals = np.full((len(rows), n_steps, width), np.nan, dtype=np.float32)
        p_ids = np.full((len(rows), max_prompt, width), -1, dtype=np.int32)
        p_vals = np.full((len(rows), max_prompt, width), np.nan, dtype=np.float32)
        for i, (p, g) in enumerate(rows):
            first = len(p) - 1  # the query position of step 0 (the prefill's last prompt token)
            ids[i, : len(g)], vals[i, : len(g)] = (
                ids_all[i, first : first + len(g)],
                vals_all[i, first : first + len(g)],
            )
            p_ids[i, : len(p)], p_vals[i, : len(p)] = ids_all[i, : len(p)], vals_all[i, : len(p)]
            tokens += len(g)
        write(seqs, ids, vals, False)
        if prompt:
            write(seqs, p_ids, p_vals, True)
    return tokens
