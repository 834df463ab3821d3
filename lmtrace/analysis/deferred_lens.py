"""The deferred logit lens of an archived run: final norm + unembedding (`capture.lens.LogitLens`)
applied to the archived residual stream, with the same rows in each product as the inline lens had,
so the values are the inline lens's bit for bit (`lmtrace lens`, `commands/lens.py`)."""

from __future__ import annotations

import numpy as np
import torch

from ..archive import layout
from ..capture.lens_stats import lens_target_columns, lens_targets
from ..exits.faults import kill_point


def deferred_lens(run, lens, layers: list[int], at: list[int], chunk: int, write, note) -> tuple[int, dict]:
    """The lens of every generated step of `run` at `layers` (resid layer index `at`), computed one
    generation batch and one block of `chunk` steps at a time; each sequence's block of ids and probs
    goes to write(seq, s0, s1, ids, probs). Returns the number of lens rows and the steps.parquet
    columns [sequence, step, layer] (lens_top1, lens_top1_prob, lens_margin and the target columns)."""
    resid = run.array("resid")
    n_seq, n_steps = resid.shape[:2]
    L, k = len(layers), lens.k
    gen_len = run.generated_len()
    top1 = np.full((n_seq, n_steps, L), -1, dtype=np.int32)
    top1_prob = np.full((n_seq, n_steps, L), np.nan, dtype=np.float32)
    margin = np.full((n_seq, n_steps, L), np.nan, dtype=np.float32)
    targets = _targets(run, n_seq, n_steps)  # [seq, step, 2]: chosen, runner-up (as the inline lens had them)
    t_rank = np.full((n_seq, n_steps, L, 2), -1, dtype=np.int32)
    t_prob = np.full((n_seq, n_steps, L, 2), np.nan, dtype=np.float32)
    n_rows = 0
    for seqs in _batches(run):
        B = len(seqs)
        n_of = np.maximum(gen_len[seqs], 0).astype(int)  # steps each sequence generated
        n = int(n_of.max())
        for s0 in range(0, n, chunk):  # one block of steps at a time, as generate writes them
            s1 = min(s0 + chunk, n_steps)
            x = np.stack([np.asarray(resid[seq, s0:s1])[:, at] for seq in seqs])  # [B, steps, L, d] float32
            ids = np.full((B, s1 - s0, L, k), -1, dtype=np.int32)
            probs = np.full((B, s1 - s0, L, k), np.nan, dtype=np.float32)
            margins = np.full((B, s1 - s0, L), np.nan, dtype=np.float32)
            for j in range(min(s1, n) - s0):
                live = n_of > s0 + j
                # The rows of one step of the whole batch, in the inline lens's order (sequence, layer),
                # finished sequences included as zeros (inline ran the lens on their pad steps and
                # dropped the result): a CPU matrix product can round a row differently depending on
                # its place in the product (e.g. the last rows of a tile), so only the same rows in
                # the same places give the inline values bit for bit.
                rows = np.where(live[:, None, None], x[:, j], np.float32(0))
                tg = np.repeat(targets[seqs, s0 + j], L, 0)  # the rows' (chosen, runner-up); 0 for finished ones
                i, p, m, tr, tp = lens.of_residuals(
                    torch.from_numpy(np.ascontiguousarray(rows)).reshape(B * L, -1), torch.from_numpy(tg)
                )
                ids[live, j] = i.reshape(B, L, k)[live]
                probs[live, j] = p.reshape(B, L, k)[live]
                margins[live, j] = m.reshape(B, L)[live]
                t_rank[np.asarray(seqs)[live], s0 + j] = tr.reshape(B, L, 2)[live]
                t_prob[np.asarray(seqs)[live], s0 + j] = tp.reshape(B, L, 2)[live]
                n_rows += int(live.sum()) * L
            for b, seq in enumerate(seqs):  # steps a sequence did not generate keep the fill values
                write(seq, s0, s1, ids[b], probs[b])
                top1[seq, s0:s1], top1_prob[seq, s0:s1] = ids[b, :, :, 0], probs[b, :, :, 0]
                margin[seq, s0:s1] = margins[b]
        note(f"lens: sequences {seqs[0]}..{seqs[-1]} ({n} steps)")
        kill_point("lens-batch")
    columns = dict(zip(layout.LENS_STEP_COLUMNS, (top1, top1_prob, margin)))
    columns.update(lens_target_columns(t_rank, t_prob, layers))
    return n_rows, columns


def _targets(run, n_seq: int, n_steps: int) -> np.ndarray:
    """[sequence, step, 2] int64: the chosen token and the runner-up (the most likely other token at
    T=1, from `alt_ids`) of every generated step, from tokens.parquet; 0 where no step was generated."""
    t = run.tokens().select(["sequence", "step", "is_prompt", "token_id", "alt_ids"]).to_pandas()
    t = t[~t.is_prompt]
    out = np.zeros((n_seq, n_steps, 2), dtype=np.int64)
    if len(t):
        alt = np.stack([np.asarray(a[:2]) for a in t.alt_ids])
        out[t.sequence.to_numpy().astype(np.int64), t.step.to_numpy().astype(np.int64)] = lens_targets(
            t.token_id.to_numpy(), alt
        )
    return out


def _batches(run) -> list[list[int]]:
    """The run's generation batches (sequence indices, in their rows' order), from `sequences.parquet`."""
    table = run.sequences()
    batches: dict[int, list[int]] = {}
    for seq, batch in sorted(zip(table.column("sequence").to_pylist(), table.column("batch").to_pylist())):
        batches.setdefault(batch, []).append(seq)
    return [batches[b] for b in sorted(batches)]
