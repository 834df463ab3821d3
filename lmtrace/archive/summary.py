"""A run in one row, from its manifest (and a quick look at its files): what `lmtrace ls` lists and
`lmtrace show` heads with. Reads no table or array."""

from __future__ import annotations

import json

from ..exits.errors import RunNotFoundError
from .layout import LOG
from .runs import dir_size, lens_state, read_manifest


def shards_done(path, m: dict) -> str | None:
    """`done/total` shards of a sharded run; None for a run of one shard."""
    n = m.get("shards", 1)
    if n <= 1:
        return None
    folder = path / "shards"
    done = 0
    for f in folder.glob("*.json") if folder.is_dir() else []:
        try:
            done += json.loads(f.read_text()).get("status") == "complete"
        except (OSError, ValueError):
            pass
    return f"{done}/{n}"


def run_progress(path, m: dict, status: str) -> dict:
    """An unfinished run's sequences done (committed as done, over every shard) of its total, and for a
    running one the estimated seconds left: the sequences not done at the rate batches finished since
    the last writer started (log.jsonl); None until one has."""
    from .batch_plan import sequences_done

    total = (m.get("shape") or {}).get("n_sequences") or m.get("n_prompts") or 0
    done = sequences_done(path, m)
    out = {"sequences_done": done, "sequences_total": total, "eta_s": None}
    if status != "running" or done >= total:
        return out
    started, since = None, 0
    try:
        lines = (path / LOG).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") in ("started", "resumed") and started is None:
            started = e["time"]  # the first writer of this (re)start: shards starting later add to the rate
        if e.get("event") in ("complete", "failed", "interrupted"):
            started, since = None, 0
        if e.get("event") == "batch_done" and started is not None:
            since += len(e.get("sequences") or [])
    if started is not None and since:
        import time

        out["eta_s"] = round((total - done) * (time.time() - started) / since)
    return out


def progress_label(p: dict) -> str | None:
    """`40/100 ~3m left`: an unfinished run's progress in `ls`; None for a complete run."""
    from ..output.progress import duration

    if "sequences_done" not in p:
        return None
    left = ""
    if p.get("eta_s") is not None:
        left = " ~" + duration(p["eta_s"], compact=True) + " left"
    return f"{p['sequences_done']}/{p['sequences_total']}{left}"


def status_label(path, m: dict, problem=None) -> str:
    """The status a run is shown with, by `lmtrace ls` and by serve's runs list and run pages alike:
    the manifest's, `killed` for a run it says is running that no live process writes
    (liveness.shown_status), `damaged` when `problem` (a committed file missing or truncated), and
    `STATUS (done/total shards done)` for an unfinished sharded run."""
    from .liveness import shown_status

    status = "damaged" if problem is not None else shown_status(path, m)
    shards = shards_done(path, m)
    return status if shards is None or status == "complete" else f"{status} ({shards} shards done)"


def run_summary(path, *, size: bool = True) -> dict:
    """The run at `path` in one row: id, status (damaged when a file is missing), kind, model, sizes, parent, edits.
    `size`: walk the directory for size_bytes (None without: a thousand runs' files are many stats)."""
    from .integrity import quick_problem

    m = read_manifest(path)
    shards = shards_done(path, m)
    problem = quick_problem(path, m)  # a complete run with a missing or truncated file (`lmtrace verify` says which)
    label = status_label(path, m, problem)  # `killed`: says running, but no live process writes it
    status = label.split(" ")[0]
    progress = run_progress(path, m, status) if status in ("running", "killed", "interrupted", "failed") else {}
    return {
        "run_id": m.get("run_id", path.name),
        "status": label,
        **progress,
        "shards_complete": shards,
        "kind": m.get("kind"),
        "model": m.get("model", {}).get("reference"),
        "prompts": m.get("n_prompts"),
        "tokens": m.get("n_generated_tokens"),
        "size_bytes": dir_size(path) if size else None,
        "created": m.get("created"),
        "completed": m.get("completed") or m.get("ended"),
        "seed": m.get("seed"),
        "parent": m.get("parent"),
        "parent_id": (m.get("parent") or {}).get("run_id"),
        "edits": edits_label(m),
        "lens": lens_state(m),
        "path": str(path),
        **({"error": f"{problem}"} if problem is not None else {}),
    }


# An intervention kind's flag on `lmtrace intervene`; kinds without one (YAML only) are written as their kind
FLAGS = {
    "ablate_head": "ablate-head",
    "ablate_layer": "ablate-layer",
    "ablate_mlp": "ablate-mlp",
    "ablate_attention": "ablate-attn",
    "ablate_neurons": "ablate-neurons",
    "mask_positions": "mask-positions",
    "ablate_feature": "feature-ablate",
    "clamp_feature": "feature-clamp",
    "steer_feature": "feature-steer",
}


def ranges(values) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8': the range syntax the CLI reads (`--mask-positions 0-2,5`)."""
    xs = sorted({int(v) for v in values})
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def edit_label(e: dict, run_from_step: int | None = None) -> str:
    """One stored intervention entry in the CLI's words: `ablate-head 12.3:mean`, `mask-positions 3-9`,
    `ablate-neurons 7:120,455 steps 0-3`, `feature-clamp l6_topk@1a2b3c4d:12=4.0` (a feature edit's SAE
    by its directory's name @ the first 8 hex digits of its weights' sha256, so same-named directories
    read apart); a `from N` equal to the run's --from-step is left to the run's label."""
    kind = str(e.get("kind", "?"))
    words = [FLAGS.get(kind, kind.replace("_", "-"))]
    mean = ":mean" if e.get("mode") == "mean" else ""
    layer = e.get("layer")
    if kind in ("ablate_head", "patch_head"):
        words.append(f"{layer}.{e.get('head')}{mean}")
    elif kind == "ablate_neurons":
        words.append(f"{layer}:{ranges(e.get('neurons') or [])}{mean}")
    elif kind == "mask_experts":
        words.append(f"{layer}:{ranges(e.get('experts') or [])}")
    elif kind == "mask_positions":
        words.append(str(e["span"]) if e.get("span") else ranges(e.get("mask") or []))
    elif kind in ("ablate_feature", "clamp_feature", "steer_feature"):  # the SAE by its directory's name
        sae = str(e.get("sae", "?")).rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
        sae += f"@{e['sae_sha256'][:8]}" if e.get("sae_sha256") else ""
        value = {"clamp_feature": f"={e.get('value')}", "steer_feature": f"*{e.get('coefficient')}"}.get(kind, "")
        words.append(f"{sae}:{e.get('feature')}{value}")
    elif layer is not None:
        words.append(f"{layer}{mean}")
    if kind in ("patch_residual", "patch_head"):
        words.append(
            f"source {e.get('source_run')}"
            + (f" sequence {e['source_sequence']}" if e.get("source_sequence") is not None else "")
        )
    if kind == "steer":
        words.append(f"alpha {e.get('alpha')}")
        words.append(
            f"vector {e['vector']}" if e.get("vector") else "from-runs " + ",".join(map(str, e.get("from_runs") or []))
        )
    steps = e.get("steps", "all")
    if isinstance(steps, dict) and steps.get("from") is not None and steps["from"] != run_from_step:
        words.append(f"from {steps['from']}")
    elif isinstance(steps, list):
        words.append(f"steps {ranges(steps)}")
    for key in ("sequences", "positions"):
        if isinstance(e.get(key), list):
            words.append(f"{key} {ranges(e[key])}")
    return " ".join(words)


def edits_label(m: dict) -> str | None:
    """An intervene child's edits in the CLI's words: `ablate-head 12.3 from 2 (rescore)`,
    `ablate-mlp 4:mean; mask-positions 0-4 (regenerate)`, `temperature 0.5 (regenerate)`; None for other runs."""
    if m.get("kind") != "intervene":
        return None
    from_step = m.get("from_step")
    parts = [edit_label(e, from_step) for e in m.get("interventions") or []]
    if not parts:
        temperature = ((m.get("spec_resolved") or {}).get("generation") or {}).get("temperature")
        parts.append(f"temperature {temperature}")
    return "; ".join(parts) + (f" from {from_step}" if from_step else "") + f" ({m.get('mode') or 'rescore'})"


def summary_or_damaged(path, *, size: bool = True) -> dict:
    """`run_summary`, or a row marked damaged when the manifest cannot be read."""
    try:
        return run_summary(path, size=size)
    except RunNotFoundError as err:  # one damaged manifest must not hide every other run
        return {
            "run_id": path.name,
            "status": "damaged",
            "kind": None,
            "model": None,
            "prompts": None,
            "tokens": None,
            "size_bytes": dir_size(path) if size else None,
            "created": None,
            "completed": None,
            "seed": None,
            "parent": None,
            "parent_id": None,
            "edits": None,
            "lens": None,
            "path": str(path),
            "error": str(err),
        }
