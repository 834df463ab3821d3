"""What a sweep measures per (cell, sequence, step), and how each metric is computed from logits.

logprob / prob   of the parent's chosen token
rank             how many tokens have a strictly larger logit than the chosen one (0 = top-1)
kl               KL(baseline || edited) over the full vocabulary, nats
logit_diff:A,B   logit of A − logit of B (token ids, or texts that are one token each)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...exits.errors import SpecError

METRICS = ("logprob", "prob", "kl", "rank", "logit_diff")


@dataclass
class Metric:
    name: str
    tokens: tuple[int, int] | None = None  # logit_diff: (A, B)

    @property
    def key(self) -> str:
        """The metric's name in the sweep's tables (`logit_diff:A,B` with token ids)."""
        return self.name if self.tokens is None else f"logit_diff:{self.tokens[0]},{self.tokens[1]}"


def _token_id(text: str, tokenizer, vocab: int, where: str) -> int:
    text = text.strip()
    if text.lstrip("-").isdigit():
        tid = int(text)
        if not 0 <= tid < vocab:
            raise SpecError(f"{where}: token id {tid} is outside the vocabulary 0..{vocab - 1}")
        return tid
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise SpecError(f"{where}: {text!r} is {len(ids)} tokens {ids}, not one; give a single token's text or its id")
    return int(ids[0])


def _split_pair(text: str) -> list[str]:
    """'" Paris"," Rome"' -> ['" Paris"', '" Rome"'] (a comma inside quotes does not split)."""
    parts, cur, quote = [], "", None
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            cur += ch
        elif ch == ",":
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def parse_metrics(names: list[str], tokenizer, vocab: int) -> list[Metric]:
    out = []
    for name in names:
        base, _, arg = name.partition(":")
        if base not in METRICS:
            raise SpecError(f"metric {name!r}: unknown; metrics: logprob, prob, kl, rank, logit_diff:A,B")
        if base == "logit_diff":
            parts = _split_pair(arg) if arg else []
            if len(parts) != 2:
                raise SpecError(
                    f'metric {name!r}: logit_diff takes two tokens, e.g. logit_diff:" Paris"," Rome" '
                    f"or logit_diff:7042,11389"
                )
            a, b = (_token_id(p, tokenizer, vocab, f"metric {name!r}") for p in parts)
            out.append(Metric("logit_diff", (a, b)))
        elif arg:
            raise SpecError(f"metric {name!r}: {base} takes no argument")
        else:
            out.append(Metric(base))
    if not out:
        raise SpecError("no metric given; metrics: logprob, prob, kl, rank, logit_diff:A,B")
    return out


def measure(
    metrics: list[Metric],
    logits: torch.Tensor,
    base: torch.Tensor,
    steps: list[int],
    tokens: list[int],
    first_step: int = 0,
) -> dict[str, np.ndarray]:
    """logits [R, n, V] float32 of R edited rows, base [n, V] the unedited forward's (row i = step
    first_step + i); tokens: the chosen token by step. Returns metric key -> [R, len(steps)] float64."""
    idx = torch.tensor(steps) - first_step
    lg = logits[:, idx]
    lp = lg.log_softmax(-1)
    base_lp = base[idx].log_softmax(-1)
    tok = torch.tensor([tokens[s] for s in steps])[None, :, None].expand(lg.shape[0], -1, 1)
    out = {}
    for m in metrics:
        if m.name == "logprob":
            v = lp.gather(-1, tok)[..., 0]
        elif m.name == "prob":
            v = lp.gather(-1, tok)[..., 0].exp()
        elif m.name == "rank":
            v = (lg > lg.gather(-1, tok)).sum(-1).float()
        elif m.name == "kl":
            v = (base_lp.exp()[None] * (base_lp[None] - lp)).sum(-1).clamp_min(0)
        else:
            a, b = m.tokens
            v = lg[..., a] - lg[..., b]
        out[m.key] = v.double().numpy()
    return out
