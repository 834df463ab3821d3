"""A run in one row, from its manifest (and a quick look at its files): what `lmtrace ls` lists and
`lmtrace show` heads with. Reads no table or array."""

from __future__ import annotations

import json

from ..errors import RunNotFoundError
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


def run_summary(path) -> dict:
    """The run at `path` in one row: id, status (damaged when a file is missing), kind, model, sizes, parent, edits."""
    from .integrity import quick_problem

    m = read_manifest(path)
    shards = shards_done(path, m)
    status = m.get("status")
    problem = quick_problem(path, m)
    if problem is not None:  # a complete run with a missing or truncated file (`lmtrace verify` says which)
        status = "damaged"
    return {
        "run_id": m.get("run_id", path.name), "status": status if shards is None or status == "complete"
        else f"{status} ({shards} shards done)", "shards_complete": shards, "kind": m.get("kind"),
        "model": m.get("model", {}).get("reference"), "prompts": m.get("n_prompts"),
        "tokens": m.get("n_generated_tokens"), "size_bytes": dir_size(path), "created": m.get("created"),
        "parent": m.get("parent"), "parent_id": (m.get("parent") or {}).get("run_id"), "edits": edits_label(m),
        "lens": lens_state(m), "path": str(path), **({"error": f"{problem}"} if problem is not None else {}),
    }


def edits_label(m: dict) -> str | None:
    """An intervene child's edits in a few words: `ablate_head 3.2; mask_positions positions=0-4 (rescore from 5)`."""
    if m.get("kind") != "intervene":
        return None
    parts = []
    for e in m.get("interventions") or []:
        fields = {k: v for k, v in e.items() if k not in ("kind", "mode") and v not in (None, [], {}, "all")}
        if fields and set(fields) <= {"layer", "head"}:
            target = ".".join(str(fields[k]) for k in ("layer", "head") if k in fields)
        else:
            target = ",".join(f"{k}={v}" for k, v in fields.items())
        parts.append(e.get("kind", "?") + (f" {target}" if target else "") + (":mean" if e.get("mode") == "mean" else ""))
    temperature = ((m.get("spec_resolved") or {}).get("generation") or {}).get("temperature")
    if not parts:
        parts.append(f"temperature {temperature}")
    where = m.get("mode") or "rescore"
    if m.get("from_step"):
        where += f" from {m['from_step']}"
    return "; ".join(parts) + f" ({where})"



def summary_or_damaged(path) -> dict:
    """`run_summary`, or a row marked damaged when the manifest cannot be read."""
    try:
        return run_summary(path)
    except RunNotFoundError as err:  # one damaged manifest must not hide every other run
        return {"run_id": path.name, "status": "damaged", "kind": None, "model": None, "prompts": None,
                "tokens": None, "size_bytes": dir_size(path), "created": None, "parent": None, "parent_id": None,
                "edits": None, "lens": None, "path": str(path), "error": str(err)}
