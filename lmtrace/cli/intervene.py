"""The `intervene` command's glue: read edits from a file and flags, run children, print the summary."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.console import Console

from ..analysis.intervention_effects import summarize
from ..capture.interventions import shorthand_entries
from ..commands.intervene import run_intervene
from ..exits.errors import SpecError


def _read_edit_spec(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: edits file not found") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: malformed YAML ({str(err).splitlines()[0]})") from None
    if isinstance(data, list):
        data = {"interventions": data}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with `interventions:` (a list of entries)")
    unknown = set(data) - {"interventions", "mode", "from_step"}
    if unknown:
        raise SpecError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: interventions, mode, from_step")
    return data


def _with_lens(result, lens: bool, progress) -> dict:
    """`--lens`: the child's deferred lens, computed with the model still in memory."""
    if not lens:
        return {}
    from ..commands.lens import lens_after

    return {"lens": lens_after(result, note=progress.message)}


def intervene_command(
    run_ref,
    spec_path,
    flags: dict,
    *,
    from_step,
    mode,
    temperatures,
    runs_dir,
    run_id,
    progress,
    json_out: bool,
    quiet: bool,
    lens: bool = False,
) -> dict:
    """Make the child run(s) (one per --temperatures value, else one) and print their effects (with
    --quiet only their ids); returns the --json summary."""
    entries, mode, from_step = _edits(flags, spec_path, mode, from_step, temperatures)
    if temperatures:
        children = _temperature_children(
            run_ref, entries, _temperature_list(temperatures, run_id), from_step, runs_dir, progress, lens
        )
    else:
        result, effects = run_intervene(
            run_ref, entries, mode=mode, from_step=from_step, runs_dir=runs_dir, run_id=run_id, progress=progress
        )
        children = [
            {
                "run_id": result.run_id,
                "mode": mode,
                "run_dir": str(result.run_dir),
                **summarize(effects.to_pandas()),
                **_with_lens(result, lens, progress),
            }
        ]
    if quiet and not json_out:  # the child ids alone, one per line, for scripts
        for child in children:
            print(child["run_id"])
    elif not json_out:
        _print(children)
    return {"parent": run_ref, "children": children}


def _edits(flags: dict, spec_path, mode, from_step, temperatures) -> tuple[list, str, int | None]:
    """The edits (--spec's `interventions:` then the shorthand flags), the mode (flag, then the spec's,
    then rescore) and --from-step (flag, then the spec's); raises SpecError for a child that would be
    a copy of its parent or a temperature sweep in rescore mode."""
    entries = shorthand_entries(**flags)
    file_mode = None
    if spec_path is not None:
        data = _read_edit_spec(spec_path)
        entries = list(data.get("interventions") or []) + entries
        file_mode = data.get("mode")
        from_step = from_step if from_step is not None else data.get("from_step")
    if not entries and not temperatures:  # (a temperature sweep without edits is a real experiment)
        raise SpecError(
            "no interventions given: the child would be a copy of the parent; pass --ablate-head, "
            "--ablate-layer, --ablate-mlp, --ablate-attn, --ablate-neurons, --mask-positions, "
            "--feature-ablate, --feature-clamp, --feature-steer, --temperatures or --spec edits.yaml"
        )
    if temperatures and (mode or file_mode) == "rescore":
        raise SpecError(
            "--temperatures regenerates one child per temperature; it cannot be combined with --mode "
            "rescore (which forces the parent's tokens, so a temperature changes nothing)"
        )
    return entries, mode or file_mode or "rescore", from_step


def _temperature_list(temperatures: str, run_id) -> list[float]:
    """--temperatures 0.5,1.0 as numbers (at least one; no --run-id, the children are several)."""
    try:
        temps = [float(t) for t in temperatures.split(",") if t.strip()]
    except ValueError:
        raise SpecError(f"--temperatures {temperatures!r}: expected numbers like 0.5,1.0") from None
    if not temps:
        raise SpecError(f"--temperatures {temperatures!r}: give at least one temperature, e.g. 0.5,1.0")
    if run_id:
        raise SpecError("--run-id cannot name several children of a temperature sweep")
    return temps


def _temperature_children(run_ref, entries: list, temps: list[float], from_step, runs_dir, progress, lens) -> list:
    """One regenerated child per temperature, each with its effects' summary (and --lens)."""
    children = []
    for t in temps:
        result, effects = run_intervene(
            run_ref,
            entries,
            mode="regenerate",
            from_step=from_step or 0,
            runs_dir=runs_dir,
            temperature=t,
            progress=progress,
        )
        children.append(
            {
                "run_id": result.run_id,
                "temperature": t,
                **summarize(effects.to_pandas()),
                **_with_lens(result, lens, progress),
            }
        )
    return children


def _print(children: list[dict]) -> None:
    from ..output.column_fit import print_fitted

    console = Console()
    headers = ["sequence", "diverges at", "parent → child token", "winner changes", "mean Δlogprob", "max KL ≥"]
    fmt = lambda v: "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    for child in children:
        label = f"temperature {child['temperature']}" if "temperature" in child else child.get("mode")
        rows = []
        for s in child["sequences"]:
            tokens = s.get("first_divergence")
            rows.append(
                [
                    str(s["sequence"]),
                    fmt(s["first_divergence_step"]),
                    "-" if not tokens else f"{tokens['parent']!r} → {tokens['child']!r}",
                    fmt(s["winner_changes"]),
                    fmt(s["mean_logprob_shift"]),
                    fmt(s["max_kl_topk"]),
                ]
            )
        print_fitted(
            console,
            headers,
            rows,
            complete_in="--json has them",
            drop_first=("winner changes", "max KL ≥"),
            keep=headers[:3],
            left=("parent → child token",),
            wrap=("parent → child token",),
            title=f"child {child['run_id']} ({label}); max KL ≥: over the stored top-k, a lower bound; "
            f"effects.parquet has every step",
        )
        if child.get("lens"):
            lens = child["lens"]
            console.print(
                f"child {child['run_id']}: "
                + (
                    f"logit lens computed ({lens['rows']} rows, {lens['seconds']:.1f} s)"
                    if lens["computed"]
                    else lens["reason"]
                ),
                markup=False,
            )
