"""`lmtrace explain`: attribute archived generated tokens to their context positions, after the fact.

Generate first, explain later: a run (even a forward-only `capture: none` one) archives every
token; `explain` rebuilds the exact context of the requested steps from `tokens.parquet`
(prompt ids + generated ids of earlier steps), reloads the run's model in float32 with eager
attention, and scores every context position for one target quantity of the token chosen at
that step. Definitions (docs/explain.md has the full text):

  target f   chosen | runner-up | contrast (= chosen − runner-up), of the `logit` or `logprob`
             at the last context position; runner-up = the most likely archived alternative that is
             not the chosen token.
  grad_x_input          score_i = Σ_d ∂f/∂e_{i,d} · e_{i,d}     (e = input embeddings)
  integrated_gradients  score_i = Σ_d (e−b)_{i,d} · Σ_k w_k ∂f/∂e_{i,d}(b + α_k (e−b)); b = zero or
                        pad-token embedding at every position; midpoint or trapezoid rule;
                        completeness error = |Σ_i score_i − (f(e) − f(b))|
  occlusion             score_i = f(x) − f(x with position i removed from the attention mask)
  attention_rollout     R = Â_{L−1} ⋯ Â_0 with Â_l = rownorm(mean_h A_{l,h} + I); score_i = R[n−1, i]
                        (archived attention only, no model)
  lrp                   score_i = Σ_d e_{i,d} · ĝ_{i,d}, ĝ the gradient under AttnLRP's rules (CP-LRP attention);
                        f = Σ_i score_i + bias relevance; also relevance per layer's attention/MLP and per head
  --sae DIR|NAME        grad_x_input and lrp also attribute to the SAE's latents at its hook and an error node
                        (the reconstruction error): a result named METHOD@SAE per SAE

This module orchestrates: resolve the run, take its explain writer key, load the model, call the
analysis (`lmtrace/analysis/attribution/`: the METHODS registry, one module per method), write
through `archive/explanations.py` (`explain/` in the run directory, an entry per method in
`manifest["explain"]`) and print (`explain_render`).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.attribution import (
    FEATURE_METHODS,
    METHODS,
    NOT_REPLAYABLE,
    Scorer,
    Settings,
    child_edits,
    explain_steps,
    parse_methods,
    result_name,
    sequence_tokens,
    unreplayable_edit,
)
from ..archive.explanations import EXPLAIN_DIR, MethodRecord, StepExplanation, write_explanation
from ..archive.reader import IncompleteRunWarning, Run
from ..archive.runs import find_run, new_run_id, runs_root
from ..exits.errors import ArchiveError, LmtraceError, SpecError
from ..output.jsonout import json_line
from ..spec.run_spec import check_device_option
from ..spec.steps import parse_steps
from .explain_render import failed_checks, render, summary

__all__ = ["ExplainResult", "NotConvergedError", "Settings", "explain_command", "explain_run"]


@dataclass
class ExplainResult:
    explain_id: str
    run_id: str
    run_dir: Path
    path: Path
    entries: list[dict]
    explanations: list[StepExplanation]
    settings: Settings
    notes: list[str] = field(default_factory=list)


def _open(run_ref: str | Path, runs_dir: str | None) -> Run:
    """The run, refused unless complete: explain writes into complete runs only (docs/batch.md)."""
    path = find_run(str(run_ref), runs_root(runs_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)  # refused below, in one line
        run = Run(path)
    if run.status != "complete":
        if run.manifest.get("kind") == "intervene":
            how = "run the intervention again (`lmtrace intervene` on its parent)"
        elif run.status == "running":
            how = (
                f"wait until it completes (if its writer is gone, finish it with `lmtrace generate --resume {run.id}`)"
            )
        else:
            how = f"finish it first with `lmtrace generate --resume {run.id}`"
        raise ArchiveError(f"run {run.id} is {run.status}, not complete: explain writes into complete runs only; {how}")
    return run


def load_scorer(run: Run, device: str | None, methods: list[str], note=lambda text: None) -> tuple[Scorer, dict]:
    """The run's model in float32 with eager attention (gradients and masks behave the same everywhere)."""
    from ..runner.models import load_run_model

    needing = ", ".join(m for m in methods if METHODS[m].needs_model)
    loaded = load_run_model(
        run.manifest,
        run.id,
        purpose=f"method(s) {needing} (attention_rollout does not need them)",
        overrides={"dtype": "float32", "attn_implementation": "eager", "device": device},
        note=note,
    )
    info = {
        "reference": loaded.reference,
        "source": loaded.source,
        "weights_sha256": loaded.weights_sha256,
        "dtype": "float32",
        "attn_implementation": "eager",
        "device": str(loaded.device),
    }
    return Scorer.of(loaded), info


def resolve_saes(run: Run, refs: list[str]) -> list[tuple[str, Path, str]]:
    """`--sae` values -> (short name, directory, weights' sha256), by `features.refs.resolve_sae_ref`; the
    same SAE named twice counts once, two SAEs of one short name are told apart (_2, _3...). Refused in one
    line (exit 2) before any weights are loaded."""
    from ..features.refs import resolve_sae_ref

    recorded = run.manifest.get("features") or []
    out: list[tuple[str, Path, str]] = []
    for ref in refs:
        found = resolve_sae_ref(ref, recorded, f"--sae {ref}", f"run {run.id}")
        name = found.name
        if any(n == name for n, _, _ in out):
            if any(s_ == found.sha256 for _, _, s_ in out):
                continue  # the same SAE twice
            name = f"{name}_{len(out) + 1}"
        out.append((name, found.path, found.sha256))
    return out


def load_saes(refs: list[tuple[str, Path, str]], scorer: Scorer):
    """Each resolved SAE read and placed at its site of the loaded model; a bad directory, an unsupported hook,
    a layer the model lacks or a d_in that does not match the site is refused in one line (exit 2)."""
    from ..analysis.attribution import SaeAtSite
    from ..capture.arch import adapter_for
    from ..features import parse_hook_name, read_sae

    adapter = adapter_for(scorer.model)
    out = []
    for name, path, sha in refs:
        sae = read_sae(path, device=scorer.device)
        if sae.cfg.transcoder:
            raise SpecError(
                f"--sae {path}: explain does not support transcoders ({sae.cfg.architecture}) as attribution "
                f"nodes yet; use an SAE (standard, jumprelu, topk)"
            )
        site = parse_hook_name(sae.cfg.hook_name, f"SAE {path}")
        site.check(adapter, sae.cfg.d_in, f"SAE {path}")
        out.append(SaeAtSite(name, path.resolve(), sha, sae, site))
    return out


def explain_run(
    run_ref: str | Path,
    steps: str | list[int],
    *,
    sequence: int = 0,
    methods: list[str] | str = ("grad_x_input",),
    settings: Settings | None = None,
    device: str | None = None,
    runs_dir: str | None = None,
    note=lambda text: None,
    saes: list[str] | tuple[str, ...] = (),
) -> ExplainResult:
    """Explain generated steps of an archived run; write the results into the run and return them. `saes`:
    SAE directories or recorded names that grad_x_input and lrp also attribute to (`--sae`)."""
    settings = (settings or Settings()).check()
    names = parse_methods(list(methods) if not isinstance(methods, str) else methods)
    check_device_option(device)
    notes: list[str] = []

    def note_(text: str) -> None:  # kept for the result (terminal and --json), and passed on
        notes.append(text)
        note(text)

    run = _open(run_ref, runs_dir)
    from ..archive.liveness import OwnerLock
    from ..exits.faults import pause_after_owning

    # One explain writer of a run at a time: a second exits 2 naming the holder's pid.
    owner = OwnerLock(run.path, "explain", run.id).acquire()
    try:
        pause_after_owning()
        return _explain_owned(run, notes, note_, note, steps, sequence, settings, names, device, list(saes))
    finally:
        owner.release()


def _explain_owned(
    run: Run,
    notes: list[str],
    note_,
    progress,
    steps,
    sequence: int,
    settings: Settings,
    names: list[str],
    device: str | None,
    sae_refs: list[str],
) -> ExplainResult:
    """explain_run's work once this process owns the run's explain writer key."""
    prompt, gen = sequence_tokens(run, sequence)
    step_list = parse_steps(",".join(map(str, steps)) if isinstance(steps, (list, tuple)) else steps, len(gen))
    settings.check_positions(len(prompt) + max(step_list), max(step_list), names)
    for name in names:  # archived-data requirements are checked before any weights are loaded
        req = METHODS[name].requirements
        missing = req(run) if req is not None else []
        if missing:
            raise ArchiveError(
                f"method {name} needs archived data run {run.id} did not capture: "
                + "; ".join(missing)
                + ". Rerun generate with those capture settings"
            )
    for name in names:  # what a method cannot explain (a quantity, a family) is refused before loading weights
        if METHODS[name].check is not None:
            METHODS[name].check(run, settings)
    if sae_refs and not any(m in FEATURE_METHODS for m in names):
        raise SpecError(
            f"--sae: attribution to an SAE's latents is made by {' and '.join(FEATURE_METHODS)}; "
            f"add -m {FEATURE_METHODS[0]} or -m {FEATURE_METHODS[1]}"
        )
    sae_found = resolve_saes(run, sae_refs)
    bad = unreplayable_edit(run)  # refuse edit kinds that cannot be replayed before loading any weights
    if bad is not None:
        i, kind = bad
        raise SpecError(
            f"run {run.id} is an intervention child with interventions[{i}] ({kind}), which "
            f"explain cannot replay: {NOT_REPLAYABLE[kind]}. Explain its parent instead"
        )
    scorer, model_info = None, None
    if any(METHODS[m].needs_model for m in names):
        progress(f"loading model {run.manifest.get('model', {}).get('reference')} (float32, eager attention)")
        scorer, model_info = load_scorer(run, device, names, progress)
    saes = load_saes(sae_found, scorer) if sae_found else []
    edits = child_edits(run, scorer, sequence, len(prompt)) if scorer is not None else None
    if edits is not None:
        model_info = {**model_info, "interventions_replayed": run.manifest["interventions"]}
    explanations = explain_steps(
        run, sequence, prompt, gen, step_list, names, settings, scorer, edits, note=note_, progress=progress, saes=saes
    )
    explain_id = new_run_id()
    records = [
        MethodRecord(
            name,
            METHODS[name].settings(settings),
            settings.target if METHODS[name].needs_model else None,
            settings.quantity if METHODS[name].needs_model else None,
            model_info if METHODS[name].needs_model else None,
        )
        for name in names
    ]
    records += [
        MethodRecord(
            result_name(name, sae.name),
            {**METHODS[name].settings(settings), "sae_top": settings.sae_top},
            settings.target,
            settings.quantity,
            model_info,
            sae=sae.record(settings.sae_top),
        )
        for name in names
        if name in FEATURE_METHODS
        for sae in saes
    ]
    entries = write_explanation(run, explain_id, records, step_list, sequence, explanations)
    return ExplainResult(
        explain_id, run.id, run.path, run.path / EXPLAIN_DIR / explain_id, entries, explanations, settings, notes
    )


def explain_command(
    run_ref: str,
    steps: str,
    *,
    sequence: int,
    methods: list[str],
    settings: Settings,
    device: str | None,
    runs_dir: str | None,
    json_out: bool,
    quiet: bool,
    top: int,
    strict: bool = False,
    saes: list[str] | tuple[str, ...] = (),
) -> ExplainResult:
    """What `lmtrace explain` does: explain, then print a rich view (or a JSON summary)."""

    def note(text: str) -> None:
        if not (quiet or json_out):
            print(text, file=sys.stderr)

    result = explain_run(
        run_ref,
        steps,
        sequence=sequence,
        methods=methods,
        settings=settings,
        device=device,
        runs_dir=runs_dir,
        note=note,
        saes=saes,
    )
    if json_out:
        print(json_line(summary(result, top)))
    elif not quiet:
        render(result, top=top)
    failed = failed_checks(result)
    if strict and failed:
        raise NotConvergedError(
            f"--strict: {len(failed)} result(s) failed their method's own check, first "
            f"{failed[0]} (results written to {result.path}; the manifest flags them)"
        )
    return result


class NotConvergedError(LmtraceError):
    """`--strict` and an attribution that failed its method's own check (IG completeness, lrp conservation):
    exit 1."""
