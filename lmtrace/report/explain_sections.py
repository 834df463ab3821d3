"""The report's attributions section (`lmtrace explain`): per shown sequence a heatmap of every
explained step's scores over its context, and lrp's relevance per head (`archive.explanations`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..archive import parquet_io
from ..archive.explanations import EXPLAIN_DIR, SCORES_PARTS, read_component
from . import figures as F
from .blobs import Blobs
from .run_data import RunData, display
from .sections import Section, key_labels
from .selection import Selection

EXPLAIN_SCORES = (EXPLAIN_DIR, SCORES_PARTS)  # as archive/explanations.py writes them


def explain_section(data: RunData, sel: Selection, blobs: Blobs) -> Section | None:
    folder = data.run.path.joinpath(*EXPLAIN_SCORES)
    files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    if not files:
        return Section(
            "explain",
            "Attributions",
            notes=[
                f"no attributions yet: `lmtrace explain {data.run.id} --steps 0,1,2 -m grad_x_input,occlusion` computes "
                f"them for the generated tokens you ask about"
            ],
        )
    t = pa.concat_tables([parquet_io.read_table(f) for f in files], promote_options="default").to_pydict()
    failed = _unconverged(data.manifest)
    sec = Section("explain", "Attributions (lmtrace explain)")
    for seq in sorted(set(t["sequence"])):
        rows: dict[tuple, dict[int, float]] = {}
        for i in range(len(t["sequence"])):
            if t["sequence"][i] != seq:
                continue
            key = (t["step"][i], t["method"][i], t["explain_id"][i], t["target"][i], t["quantity"][i])
            rows.setdefault(key, {})[t["position"][i]] = t["score"][i]
        if not rows:
            continue
        keys = sorted(rows)
        tok = data.tokens(seq)
        width = max(max(r) for r in rows.values()) + 1
        z = np.full((len(keys), width), np.nan, dtype=np.float32)
        raw = np.full((len(keys), width), np.nan, dtype=np.float32)
        for i, key in enumerate(keys):
            for p, v in rows[key].items():
                raw[i, p] = v
            scale = np.nanmax(np.abs(raw[i])) if np.isfinite(raw[i]).any() else 0.0
            z[i] = raw[i] / scale if scale else raw[i]
        labels, invocations = _explain_row_labels(keys, seq, tok, failed)
        if len(invocations) > 1:  # rows of one step and method from several invocations are numbered: say which
            sec.notes.append(
                f"sequence {seq}: rows from different `lmtrace explain` invocations are numbered "
                + ", ".join(f"[{i}] = explain {eid}" for eid, i in invocations.items())
                + " (their settings are in manifest.json, `explain`)"
            )
        if any((k[2], k[1], seq, k[0]) in failed for k in keys):
            sec.notes.append(
                f"sequence {seq}: rows marked NOT CONVERGED are integrated-gradients results whose scores "
                f"do not add up to f(x) − f(baseline) within the tolerance; trust them no further than "
                f"their completeness error in manifest.json (docs/explain.md)"
            )
        sec.figures.append(
            F.heatmap(
                f"explain-{seq}",
                f"sequence {seq}: attribution of each explained step to its context "
                f"(rows scaled to their largest |score|)",
                blobs.add(f"explain_z_{seq}", z, "float32"),
                blobs.add_texts(f"explain_keys_{seq}", key_labels(tok.context_texts(width))),
                blobs.add_texts(f"explain_rows_{seq}", labels),
                zmin=-1,
                zmax=1,
                colorscale=F.DIVERGING,
                customdata=blobs.add(f"explain_raw_{seq}", raw, "float32"),
                n_rows=len(keys),
                ytitle="step method (target)",
                hover="%{y}<br>%{x}<br>score %{customdata:.4g}",
                zlabel="score / max|score|",
            )
        )
    _head_relevance_figures(data, sec, blobs)
    return sec


HEAD_FIGURES = 8  # lrp head-relevance heatmaps shown per report (one per explained step, the first ones)


def _head_relevance_figures(data: RunData, sec: Section, blobs: Blobs) -> None:
    """One heatmap [layer, head] of lrp's per-head relevance per explained step (archived beside the scores)."""
    shown = 0
    for entry in data.manifest.get("explain") or []:
        if not (entry.get("components") or {}).get("heads"):
            continue
        heads = read_component(data.run, entry, "heads")
        L, H = heads.shape[1:]
        for k, step in enumerate(entry["steps"]):
            if shown == HEAD_FIGURES:
                sec.notes.append(
                    f"head relevance: the first {HEAD_FIGURES} lrp steps are shown; the rest are in "
                    f"manifest.json `explain[].components.heads` (docs/explain.md)"
                )
                return
            raw = heads[k]
            scale = float(np.nanmax(np.abs(raw))) if np.isfinite(raw).any() else 0.0
            name = f"lrp_heads_{entry['id']}_{entry['sequence']}_{step}"
            sec.figures.append(
                F.heatmap(
                    f"explain-heads-{entry['id']}-{entry['sequence']}-{step}",
                    f"sequence {entry['sequence']} step {step}: lrp relevance per head ({entry['target']}; rows = layers, "
                    f"scaled to the largest |relevance|)",
                    blobs.add(name, raw / scale if scale else raw, "float32"),
                    blobs.add_texts(name + "_x", [f"H{h}" for h in range(H)]),
                    blobs.add_texts(name + "_y", [f"L{i}" for i in range(L)]),
                    zmin=-1,
                    zmax=1,
                    colorscale=F.DIVERGING,
                    customdata=blobs.add(name + "_raw", raw, "float32"),
                    n_rows=L,
                    xtitle="head",
                    ytitle="layer",
                    hover="%{y} %{x}<br>relevance %{customdata:.4g}",
                    zlabel="relevance / max|relevance|",
                )
            )
            shown += 1


def _explain_row_labels(keys: list[tuple], seq: int, tok, failed: set[tuple]) -> tuple[list[str], dict[str, int]]:
    """Row labels of the attribution heatmap: step, method, target and quantity (none for attention rollout) and
    the explained token. Where one step and method were explained by several invocations (other settings), each
    such row gets its invocation's number [i]; returns the labels and {explain id: number} of those invocations."""

    def base(k):
        step, method, _, target, quantity = k
        what = f" ({target} {quantity})" if target is not None else ""
        token = display(tok.gen["token_text"][step]) if step < tok.n_steps else ""
        return f"{'NOT CONVERGED ' if (k[2], method, seq, step) in failed else ''}s{step} {method}{what} {token}"

    count: dict[str, int] = {}
    for k in keys:
        count[base(k)] = count.get(base(k), 0) + 1
    repeated = sorted({k[2] for k in keys if count[base(k)] > 1})
    invocations = {eid: i + 1 for i, eid in enumerate(repeated)}
    return [base(k) + (f" [{invocations[k[2]]}]" if count[base(k)] > 1 else "") for k in keys], invocations


def _unconverged(manifest: dict) -> set[tuple]:
    """(explain id, method, sequence, step) of every attribution whose manifest result says converged: false."""
    out = set()
    for entry in manifest.get("explain") or []:
        for r in entry.get("results") or []:
            if r.get("converged") is False:
                out.add((entry.get("id"), entry.get("method"), entry.get("sequence"), r.get("step")))
    return out
