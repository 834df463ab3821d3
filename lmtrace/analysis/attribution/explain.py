"""Explain steps of one archived sequence: rebuild each step's exact context from the archived tokens
(prompt ids + ids generated before it), check that the loaded model (with an intervention child's
edits replayed) reproduces the archived logprob of the chosen token, and run every requested method
on it. Returns one `StepExplanation` per (method, step); writing them is `archive.explanations`'."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable

import numpy as np
import torch

from ...archive.explanations import StepExplanation
from ...archive.reader import Run
from ...exits.errors import ArchiveError, LmtraceError, SpecError
from .feature_nodes import FEATURE_METHODS, SaeAtSite, attribute_to_features, result_name, result_shortfall
from .registry import METHODS, StepContext
from .replay import REPLAY_TOLERANCE, ContextEdits
from .settings import Settings
from .targets import Scorer


def sequence_tokens(run: Run, sequence: int):
    """(prompt rows by position, generated rows by step) of one sequence, from tokens.parquet (pandas frames)."""
    t = run.tokens().to_pandas()
    n_seq = int(run.manifest.get("n_prompts") or run.shape.get("n_sequences") or 0)
    if not 0 <= sequence < max(n_seq, 1) or not (t.sequence == sequence).any():
        raise SpecError(f"--sequence {sequence} out of range: run {run.id} has {n_seq} sequence(s) (0..{n_seq - 1})")
    t = t[t.sequence == sequence]
    prompt = t[t.is_prompt].sort_values("position")
    gen = t[~t.is_prompt].sort_values("step")
    return prompt, gen


def runner_up(chosen: int, alt_ids) -> int:
    """The most likely archived alternative that is not the chosen token."""
    for a in list(alt_ids if alt_ids is not None else []):
        if int(a) != chosen:
            return int(a)
    raise ArchiveError("no archived alternative other than the chosen token: cannot define the runner-up")


def explain_steps(
    run: Run,
    sequence: int,
    prompt,
    gen,
    steps: list[int],
    names: list[str],
    settings: Settings,
    scorer: Scorer | None,
    edits: ContextEdits | None,
    note: Callable[[str], None] = lambda text: None,
    progress: Callable[[str], None] = lambda text: None,
    saes: tuple[SaeAtSite, ...] | list[SaeAtSite] = (),
) -> list[StepExplanation]:
    """Every method of `names` on every step of `steps` of `sequence` (`prompt`, `gen` from `sequence_tokens`).

    `scorer` is the run's model (None when no method needs one); `edits` an intervention child's edits, installed
    on it for the duration. `note` receives what the user should read (mismatches, non-convergence), `progress`
    what is being done. Each of `saes` adds, per method that can (FEATURE_METHODS), a result attributing to the SAE's
    latents and error node (`feature_nodes`), named `result_name(method, sae.name)`."""
    prompt_ids = [int(x) for x in prompt.token_id]
    prompt_texts = list(prompt.token_text)
    gen_ids = [int(x) for x in gen.token_id]
    gen_texts = list(gen.token_text)
    explanations: list[StepExplanation] = []
    run_dtype = str(run.manifest.get("dtype") or (run.manifest.get("model") or {}).get("dtype") or "")
    with edits.attached() if edits is not None else nullcontext():
        if scorer is not None:
            scorer.edits = edits
        try:
            for step in steps:
                row = gen.iloc[step]
                if int(row.step) != step:
                    raise ArchiveError(f"run {run.id}: sequence {sequence} has no archived token for step {step}")
                if edits is not None:
                    edits.check_step(step, run.id)
                chosen = int(row.token_id)
                ctx = StepContext(
                    run=run,
                    sequence=sequence,
                    step=step,
                    prompt_len=len(prompt_ids),
                    ids=prompt_ids + gen_ids[:step],
                    chosen_id=chosen,
                    runner_up_id=runner_up(chosen, row.alt_ids),
                    archived_logprob=float(row.logprob),
                    settings=settings,
                    scorer=scorer,
                )
                check = _reproduction_check(ctx, edits, run_dtype, note) if scorer is not None else {}
                texts = prompt_texts + gen_texts[:step]
                for name in names:
                    for label, r, r_info in _method_results(ctx, name, saes, check, note, progress):
                        explanations.append(
                            StepExplanation(
                                label,
                                sequence,
                                step,
                                chosen,
                                ctx.runner_up_id,
                                np.arange(ctx.n),
                                ctx.ids,
                                texts,
                                [True] * len(prompt_ids) + [False] * step,
                                r.scores,
                                r_info,
                                target_text=str(row.token_text),
                                runner_up_text=scorer.tokenizer.decode([ctx.runner_up_id])
                                if scorer is not None
                                else "",
                                components=r.components,
                                latents=r.latents,
                            )
                        )
        finally:
            if scorer is not None:
                scorer.edits = None
    return explanations


def _method_results(ctx: StepContext, name: str, saes, check: dict, note, progress) -> list[tuple]:
    """(result name, MethodResult, info) of one method on one step, then one per SAE it attributes to; a result
    that fails its own check is noted."""
    where = f"sequence {ctx.sequence} step {ctx.step}"
    progress(f"{where}: {name}")
    res = METHODS[name].fn(ctx)
    if res.scores.shape != (ctx.n,):
        raise LmtraceError(f"method {name} returned {res.scores.shape} scores for a context of {ctx.n}")
    failed = METHODS[name].failed_check(res.info, ctx.settings)
    if failed is not None:  # the method's own check (IG completeness, lrp conservation)
        note(f"{where}: {name} {failed}")
    out = [(name, res, {**res.info, **(check if METHODS[name].needs_model else {})})]
    for sae in saes if name in FEATURE_METHODS else ():
        label = result_name(name, sae.name)
        progress(f"{where}: {label}")
        sres = attribute_to_features(ctx, name, sae, ctx.settings.sae_top)
        failed = result_shortfall(label, sres.info, ctx.settings)
        if failed is not None:
            note(f"{where}: {label} {failed}")
        out.append((label, sres, {**sres.info, **check}))
    return out


def _reproduction_check(ctx: StepContext, edits: ContextEdits | None, run_dtype: str, note) -> dict:
    """The rebuilt context (and replayed edits) must reproduce what the run saw: the chosen token's logprob,
    recomputed and archived. A float32 child off by more than REPLAY_TOLERANCE is refused (nothing is written)."""
    scorer, lp_archived = ctx.scorer, ctx.archived_logprob
    with torch.no_grad():
        lp = scorer.logits(scorer.embeddings(ctx.ids)[None]).float().log_softmax(-1)[0, ctx.chosen_id].item()
    check = {"recomputed_logprob": lp, "archived_logprob": lp_archived}
    diff = abs(lp - lp_archived) if math.isfinite(lp_archived) else math.inf
    if edits is not None:
        check["interventions_replayed"] = True
        if run_dtype == "float32" and not diff <= REPLAY_TOLERANCE:
            raise LmtraceError(
                f"run {ctx.run.id} step {ctx.step}: with the child's {len(edits.entries)} intervention(s) "
                f"replayed, the chosen token's logprob is {lp:.6f} but the child archived "
                f"{lp_archived:.6f} (|difference| {diff:.2e} > {REPLAY_TOLERANCE:g}): the "
                f"replay does not reproduce the child, so its attributions would describe another "
                f"model; nothing was written"
            )
    if diff > 0.05 or (edits is not None and diff > REPLAY_TOLERANCE):
        note(
            f"step {ctx.step}: the float32 model{' with the replayed edits' if edits else ''} gives the "
            f"chosen token logprob {lp:.4f}, the run archived {lp_archived:.4f} (run dtype "
            f"{run_dtype or 'unknown'}); the attributions describe the float32 model"
        )
    return check
