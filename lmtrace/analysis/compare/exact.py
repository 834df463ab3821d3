"""Exact rescoring for `lmtrace compare --exact`: full-vocabulary KL/JS and logit differences at paired steps.

The default comparison reads only the archives, so its KL/JS use the stored top-k and are lower
bounds. With `--exact` each side's model is loaded (once, when both runs used the same model and
weights) in float32 with eager attention, an intervention child's edits are replayed with
intervene's own hooks (`attribution.child_edits`, as `lmtrace explain` does), and one forward per
pair and side over the shared context (prompt + the tokens generated before the first divergence)
gives both sides' next-token distributions at every paired step: position P−1+s is step s.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext

import torch

from ...exits.errors import SpecError
from ...spec.steps import parse_steps
from ..attribution import NOT_REPLAYABLE, Scorer, child_edits, unreplayable_edit


def _parse_steps(text: str | None) -> set[int] | None:
    """--exact-steps: None for every paired step; the range is checked against the pairs later."""
    if text is None or str(text).strip() in ("", "all"):
        return None
    return set(parse_steps(text, sys.maxsize, option="--exact-steps"))


def _load(side, device):
    from ...runner.models import load_run_model

    loaded = load_run_model(
        side.run.manifest,
        side.run.id,
        purpose="compare --exact (without it compare loads no model)",
        overrides={"dtype": "float32", "attn_implementation": "eager", "device": device},
    )
    return Scorer.of(loaded)


def _same_model(A, B) -> bool:
    ma, mb = A.run.manifest, B.run.manifest
    wa, wb = (ma.get("model") or {}).get("weights_sha256"), (mb.get("model") or {}).get("weights_sha256")
    ref_a = ((ma.get("spec_resolved") or {}).get("model") or {}).get("ref")
    ref_b = ((mb.get("spec_resolved") or {}).get("model") or {}).get("ref")
    return wa is not None and wa == wb and ref_a == ref_b


def _logits(scorer, side, seq: int, ids: list[int], prompt_len: int, wanted: list[int]) -> torch.Tensor:
    """[len(wanted), vocab] float64 logits of the side's model (its edits replayed) at steps `wanted`."""
    edits = child_edits(side.run, scorer, seq, prompt_len)
    n = len(ids)
    with torch.no_grad(), edits.attached() if edits is not None else nullcontext():
        mask = torch.ones((1, n), dtype=torch.long, device=scorer.device)
        if edits is not None:
            edits.check_step(n - prompt_len, side.run.id)
            edits.begin_forward(1, n, scorer.device)
            mask = edits.mask(mask)
        out = scorer.model(
            input_ids=torch.tensor([ids], device=scorer.device),
            attention_mask=mask,
            position_ids=torch.arange(n, device=scorer.device)[None],
            use_cache=False,
        )
    rows = torch.tensor([prompt_len - 1 + s for s in wanted], device=scorer.device)
    return out.logits[0, rows].double().cpu()


def exact_figures(
    A,
    B,
    pairs: list[tuple[int, int]],
    step_rows: list[dict],
    steps: str | None,
    device: str | None,
    note=lambda text: None,
) -> dict:
    """Fill the exact_* columns of the paired rows of `step_rows` (in place); return a summary with a note."""
    for side in (A, B):  # refuse before loading anything
        bad = unreplayable_edit(side.run)
        if bad is not None:
            i, kind = bad
            raise SpecError(
                f"--exact: run {side.label} ({side.run.id}) is an intervention child with "
                f"interventions[{i}] ({kind}), which cannot be replayed: {NOT_REPLAYABLE[kind]}"
            )
    chosen = _parse_steps(steps)
    note(f"--exact: loading the model of run A ({A.run.manifest.get('model', {}).get('reference')}, float32)")
    scorer_a = _load(A, device)
    scorer_b = scorer_a if _same_model(A, B) else None
    if scorer_b is None:
        note(f"--exact: loading the model of run B ({B.run.manifest.get('model', {}).get('reference')}, float32)")
        scorer_b = _load(B, device)
    by_pair: dict[int, list[dict]] = {}
    for r in step_rows:
        if (
            r["context_identical"]
            and r["token_a"] is not None
            and r["token_b"] is not None
            and (chosen is None or r["step"] in chosen)
        ):
            by_pair.setdefault(r["pair"], []).append(r)
    worst = {"A": 0.0, "B": 0.0}
    done = 0
    for k, rows in by_pair.items():
        sa, sb = pairs[k]
        wanted = [r["step"] for r in rows]
        prompt = list(A.prompt_ids[sa])
        gen = [int(x) for x in A.gen[sa]["token_id"][: max(wanted)]]  # identical on both sides before the divergence
        ids = prompt + gen
        xa = _logits(scorer_a, A, sa, ids, len(prompt), wanted)
        xb = _logits(scorer_b, B, sb, ids, len(prompt), wanted)
        la, lb = xa.log_softmax(-1), xb.log_softmax(-1)
        pa_, pb_ = la.exp(), lb.exp()
        m = 0.5 * (pa_ + pb_)
        lm = m.clamp_min(1e-300).log()
        kl_ab = (pa_ * (la - lb)).sum(-1)
        kl_ba = (pb_ * (lb - la)).sum(-1)
        js = 0.5 * (pa_ * (la - lm)).sum(-1) + 0.5 * (pb_ * (lb - lm)).sum(-1)
        diff = xb - xa
        for j, r in enumerate(rows):
            r["exact_max_abs_logit_diff"] = float(diff[j].abs().max())
            r["exact_chosen_logit_diff"] = float(diff[j, r["token_a"]])
            r["exact_kl_ab"] = float(kl_ab[j])
            r["exact_kl_ba"] = float(kl_ba[j])
            r["exact_js"] = max(float(js[j]), 0.0)
            ta, tb = r["token_a"], r["token_b"]
            for tag, lp, tok, side in (("A", la, ta, "a"), ("B", lb, tb, "b")):
                archived = r[f"logprob_{side}"]
                if archived is not None and math.isfinite(archived):
                    worst[tag] = max(worst[tag], abs(float(lp[j, tok]) - archived))
        done += len(rows)
    dtypes = {tag: str(side.run.manifest.get("dtype")) for tag, side in (("A", A), ("B", B))}
    text = (
        f"--exact: full-vocabulary KL/JS at {done} paired step(s) from the models (float32, eager); recomputed vs "
        f"archived chosen-token logprob: max |difference| A {worst['A']:.1e}, B {worst['B']:.1e} nats "
        f"(run dtypes {dtypes['A']}/{dtypes['B']})"
    )
    for tag in ("A", "B"):
        if dtypes[tag] == "float32" and worst[tag] > 1e-4:
            text += f"; WARNING: run {tag} is not reproduced to 1e-4, its exact figures describe the float32 model"
    return {"steps": done, "max_logprob_mismatch": worst, "note": text}
