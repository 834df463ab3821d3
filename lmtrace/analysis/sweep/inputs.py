"""The sweep's inputs: the parent run (and the patch source), the sequences, measured steps, cells and
metrics, each checked against the runs before the model is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from ...capture.interventions import parse_range_list
from ...exits.errors import SpecError
from ...spec.sweep_spec import SweepSpec
from . import attribution_run as sweep_attribution
from . import feature_cells
from .cells import Cell, build_cells
from .checks import check_source, measured_steps
from .metrics import Metric, parse_metrics


@dataclass
class SweepInputs:
    """Everything a sweep needs from its runs, checked before the model is loaded."""

    parent: object  # archive Run
    view: object  # ParentView of the parent
    seqs: list[int]
    seq_steps: dict[int, list[int]]
    cells: list[Cell]
    metrics: list[Metric]
    from_step: int
    source_run: object | None = None
    source_view: object | None = None
    pairs: dict | None = None  # patch: parent sequence -> (source sequence, pair id)
    features: object | None = None  # --over features: the SweepSae
    top_features: int | None = None  # --over features without --features: cells chosen once the model is loaded
    feature_positions: list[int] | None = None  # and their --positions


def sweep_inputs(parent_ref: str, spec: SweepSpec, runs_dir: str | None) -> SweepInputs:
    """Resolve the parent (and the patch source) and validate the spec against them; raises SpecError."""
    from ...archive.pairs import pair_sequences
    from ...archive.reader import open_run
    from ...runner.parent import ParentView, tokenizer_of

    parent = open_run(parent_ref, runs_dir, require_complete=True)
    view = ParentView.read(parent)
    n_seq = len(view.prompt_ids)
    cfg = parent.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    seqs = (
        list(range(n_seq)) if spec.sequences == "all" else sorted(set(parse_range_list(spec.sequences, "--sequences")))
    )
    bad = [s for s in seqs if not 0 <= s < n_seq]
    if bad:
        raise SpecError(f"--sequences: {bad} out of range: run {parent.id} has sequences 0..{n_seq - 1}")
    if not seqs:
        raise SpecError("--sequences: the sweep is empty (no sequences)")
    from_step = spec.from_step or 0
    seq_steps = {s: measured_steps(spec.steps, from_step, len(view.generated[s]), s, parent.id) for s in seqs}
    prompt_len = min(len(view.prompt_ids[s]) for s in seqs)
    longest = max(len(view.prompt_ids[s]) + max(seq_steps[s]) for s in seqs)  # the longest measured context
    edited = range(prompt_len - 1 + from_step, longest) if from_step else None
    cells, features, top = _cells(spec, parent, n_layers, prompt_len, edited, seq_steps)
    first_edited = min(len(view.prompt_ids[s]) - 1 + from_step for s in seqs)
    for c in cells:
        if c.position is None:
            continue
        if c.position >= longest:
            raise SpecError(f"positions: {c.position} is past every measured context (longest {longest} tokens)")
        if from_step and c.component != "position" and c.position < first_edited:
            raise SpecError(
                f"positions: {c.position} is in the unedited prefix of every sequence: with --from-step "
                f"{from_step} edits apply at positions {first_edited} and later (step s is computed at "
                f"position prompt length - 1 + s)"
            )
    at = None if spec.positions is None else sorted({c.position for c in cells})
    if top is not None:
        cells = []  # the positions are checked; the features are chosen once the model is loaded
    tokenizer = tokenizer_of(parent)
    metrics = parse_metrics(spec.metrics, tokenizer, len(tokenizer))
    inputs = SweepInputs(parent, view, seqs, seq_steps, cells, metrics, from_step, features=features)
    inputs.top_features, inputs.feature_positions = top, at
    sweep_attribution.check(spec, metrics)
    if spec.edit == "patch":
        if spec.source is None:
            raise SpecError("--edit patch needs --source RUN_B (the run whose activations are patched in)")
        source_run = open_run(spec.source, parent.path.parent, require_complete=True)
        check_source(parent, source_run)
        source_view = ParentView.read(source_run)
        inputs.pairs = pair_sequences(parent, source_run, seqs, spec.pair_by)
        for s in seqs:
            t, pair = inputs.pairs[s]
            a, b = len(view.prompt_ids[s]), len(source_view.prompt_ids[t])
            if a != b:
                raise SpecError(
                    f"pair {pair} (sequence {s} of run {parent.id}, sequence {t} of the source run "
                    f"{source_run.id}): the prompts are {a} and {b} tokens; patching pairs positions, so "
                    f"the prompts of a pair must have the same token length"
                )
        inputs.source_run, inputs.source_view = source_run, source_view
    elif spec.source is not None or spec.pair_by is not None:
        raise SpecError(f"--{'source' if spec.source is not None else 'pair-by'} is for --edit patch")
    return inputs


def _cells(
    spec: SweepSpec, parent, n_layers: int, prompt_len: int, edited, seq_steps: dict
) -> tuple[list[Cell], object, int | None]:
    """(the cells, the SweepSae of --over features or None, the N of --top-features when the features are
    chosen once the model is loaded: then the cells hold feature 0 at the swept positions, for the checks).
    The top features of an SAE whose latents the run archived are chosen here, from the archive."""
    shape = parent.shape
    if not feature_cells.is_features(spec.over):
        for key in ("sae", "features", "top_features", "value"):
            if getattr(spec, key) is not None:
                raise SpecError(f"--{key.replace('_', '-')} is for --over features")
        if spec.edit == "clamp":
            raise SpecError("--edit clamp is for --over features (a latent set to --value V)")
        cells = build_cells(
            spec.over,
            spec.edit,
            spec.positions,
            n_layers,
            shape["n_heads"],
            shape.get("d_ffn") or 0,
            prompt_len,
            edited,
        )
        return cells, None, None
    if spec.sae is None:
        raise SpecError("--over features needs --sae DIR (a SAELens directory, or the run's short name for one)")
    features = feature_cells.resolve_sae(parent, spec.sae)
    ids = feature_cells.check_feature_spec(spec, features.sae.cfg.d_sae, features.name)
    top = None if ids is not None else spec.top_features or feature_cells.DEFAULT_TOP_FEATURES
    if top is not None and features.archived:
        maxima = feature_cells.maxima_from_archive(parent, features.name, seq_steps, features.sae.cfg.d_sae)
        ids, top = feature_cells.top_features(maxima, top), None
        if not ids:
            raise SpecError(f"--over features: no feature of SAE {features.name} is active at the measured steps")
    at = None
    if spec.positions is not None:
        at = [c.position for c in build_cells("positions", "zero", spec.positions, n_layers, 0, 0, prompt_len)]
    cells = feature_cells.feature_cells([0] if ids is None else ids, features.site.layer, at)
    return cells, features, top
