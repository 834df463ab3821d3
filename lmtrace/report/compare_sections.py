"""The sections of a comparison report (`lmtrace report A B`, `lmtrace compare A B --html PATH`),
drawn from a `Comparison` (lmtrace.analysis.compare): nothing is recomputed here."""

from __future__ import annotations

import numpy as np

from . import figures as F
from .blobs import Blobs
from .run_data import display
from .sections import Section, esc, fmt


def _nan(values) -> np.ndarray:
    return np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float32)


def summary_section(cmp) -> Section:
    rows = []
    for label, info in (("A", cmp.a), ("B", cmp.b)):
        g = info["generation"]
        rows.append(
            f"<tr><th>{label}</th><td><code>{esc(info['run_id'])}</code> ({esc(info['status'])}), "
            f"{esc(info['model'])}, T={esc(g['temperature'])} top_k={esc(g['top_k'])} top_p={esc(g['top_p'])} "
            f"seed={esc(g['seed'])}</td></tr>"
        )
    diffs = "".join(
        f"<tr><td>{esc(d['key'])}</td><td>{esc(d['a'])}</td><td>{esc(d['b'])}</td></tr>"
        for d in cmp.spec_differences[:40]
    )
    body = (
        f"<p><b>{esc(cmp.verdict)}</b></p><table class='kv'>{''.join(rows)}</table>"
        + (
            f"<h3>differences in the resolved specs</h3><table class='grid'><tr><th>key</th><th>A</th><th>B</th></tr>"
            f"{diffs}</table>"
            if diffs
            else "<p>no difference in the resolved specs.</p>"
        )
        + f"<p>pairing by {esc(cmp.pairing['method'])}: {len(cmp.pairing['pairs'])} pair(s)</p>"
    )
    return Section("summary", "Comparison", body)


def _pair_html(p: dict) -> str:
    """One pair's heading (where it first diverged), both texts side by side from their common
    prefix, the divergence's explanation and the step-0 logit difference when the comparison has them."""
    d = p["first_divergence"]
    where = (
        "prompts differ"
        if not p["same_prompt_ids"]
        else "no divergence"
        if d is None
        else f"first divergence at step {d['step']} ({d.get('kind')})"
    )
    common = esc(p["text"]["common"])
    mark = "<b style='color:#d62728'>▸</b>" if d is not None else ""
    html = (
        f"<h3>pair {p['pair']}: A{p['seq_a']} ↔ B{p['seq_b']} <small>{esc(where)}</small></h3>"
        f"<table class='grid' style='width:100%'><tr><th>A</th><th>B</th></tr><tr>"
        f"<td class='strip'>{common}{mark}<span style='background:#d6e9f8'>{esc(p['text']['a'])}</span></td>"
        f"<td class='strip'>{common}{mark}<span style='background:#f8d6ec'>{esc(p['text']['b'])}</span></td>"
        f"</tr></table>"
    )
    if d is not None and d.get("explanation"):
        html += f"<p class='note'>{esc(d['explanation'])}</p>"
    ld = p.get("step0_logit_diff")
    if ld is not None:
        html += (
            f"<p>step-0 logit difference, A's {esc(repr(ld['text_a']))} − B's {esc(repr(ld['text_b']))}: "
            f"under A {esc(fmt(ld['under_a']))}, under B {esc(fmt(ld['under_b']))} nats "
            f"(– where a run did not store one of the tokens; docs/compare.md)</p>"
        )
    return html


def _pair_timeline(p: dict, steps: dict, blobs: Blobs) -> dict | None:
    """JS, KL(A‖B) and the change in A's token's logprob over one pair's paired steps (`steps`: the
    comparison's per_step columns), the first divergence marked; None without a paired step."""
    k, d = p["pair"], p["first_divergence"]
    # paired steps only (identical contexts: up to and including the first divergence); after it each side
    # saw its own text and a difference would compare two contexts
    idx = [i for i, pk in enumerate(steps.get("pair", [])) if pk == k and steps["context_identical"][i]]
    if not idx:
        return None
    x = blobs.add(f"cmp_steps_{k}", np.asarray([steps["step"][i] for i in idx], dtype=np.int32))
    labels = blobs.add_texts(
        f"cmp_labels_{k}",
        [
            f"step {steps['step'][i]}: A {display(steps['text_a'][i] or '')!r} / B {display(steps['text_b'][i] or '')!r}"
            f" ({steps['phase'][i]})"
            for i in idx
        ],
    )
    series = [
        {
            "name": "JS (nats)",
            "x": x,
            "y": blobs.add(f"cmp_js_{k}", _nan(steps["js"][i] for i in idx), "float32"),
            "text": labels,
        },
        {
            "name": "KL(A‖B) (nats)",
            "x": x,
            "y": blobs.add(f"cmp_kl_{k}", _nan(steps["kl_ab"][i] for i in idx), "float32"),
            "text": labels,
        },
    ]
    # A's token in both distributions: the same token on both sides before the divergence, A's choice at it
    lp_a, lp_a_b = _nan(steps["logprob_a"][i] for i in idx), _nan(steps["logprob_a_under_b"][i] for i in idx)
    series.append(
        {
            "name": "Δ logprob of A's token (B − A)",
            "x": x,
            "y": blobs.add(f"cmp_dlp_{k}", lp_a_b - lp_a, "float32"),
            "text": labels,
        }
    )
    shapes = [F.vline(d["step"], "first divergence")] if d is not None else None
    return F.lines(
        f"cmp-timeline-{k}",
        f"pair {k}: next-token distribution shift per paired step "
        "(identical contexts; steps after the first divergence are not compared)",
        series,
        xtitle="step",
        ytitle="nats",
        shapes=shapes,
    )


def pairs_section(cmp, blobs: Blobs) -> Section:
    """The first ten sequence pairs: their texts and where they diverged, and each one's timeline of
    paired steps; a note counting the pairs left out."""
    sec = Section("pairs", "Divergence per sequence pair")
    steps = cmp.per_step.to_pydict() if cmp.per_step.num_rows else {}
    for p in cmp.pairs[:10]:
        sec.html += _pair_html(p)
        timeline = _pair_timeline(p, steps, blobs)
        if timeline is not None:
            sec.figures.append(timeline)
    if len(cmp.pairs) > 10:
        sec.notes.append(f"{len(cmp.pairs) - 10} more pair(s): see `lmtrace compare --json` or `--out DIR`")
    return sec


def layers_section(cmp, blobs: Blobs) -> Section:
    sec = Section("cmp-layers", "Layers and heads that changed")
    if not cmp.layers:
        sec.notes.append("no per-layer figures: the runs share no captured layer or no paired step")
        return sec
    rows = sorted(cmp.layers, key=lambda r: r["layer"])
    x = blobs.add("cmp_layer_x", np.asarray([r["layer"] for r in rows], dtype=np.int32))
    series = [
        {"name": label, "x": x, "y": blobs.add(f"cmp_layer_{key}", _nan(r[key] for r in rows), "float32")}
        for key, label in (
            ("delta_norm_rel_change", "Δ layer-output norm (relative)"),
            ("resid_norm_rel_change", "Δ residual norm (relative)"),
            ("attn_js_mean", "attention JS, mean over heads and steps"),
        )
    ]
    sec.figures.append(
        F.lines(
            "cmp-layers",
            f"per-layer change over paired steps (changes start at layer {fmt(cmp.first_changed_layer)})",
            series,
            xtitle="layer",
            ytitle="change",
        )
    )
    if cmp.heads:
        layers = sorted({r["layer"] for r in cmp.heads})
        n_heads = max(r["q_head"] for r in cmp.heads) + 1
        mean = np.full((len(layers), n_heads), np.nan, dtype=np.float32)
        mx = np.full_like(mean, np.nan)
        row = {layer: i for i, layer in enumerate(layers)}
        for r in cmp.heads:
            mean[row[r["layer"]], r["q_head"]] = r["attn_js_mean"]
            mx[row[r["layer"]], r["q_head"]] = r["attn_js_max"]
        top = float(np.nanmax(mx)) if np.isfinite(mx).any() else 1.0
        zm = blobs.add("cmp_heads_mean", mean, "float32")
        sec.figures.append(
            F.heatmap(
                "cmp-heads",
                "attention change per head: JS between A's and B's rows (nats)",
                zm,
                blobs.add_texts("cmp_heads_x", [f"H{h}" for h in range(n_heads)]),
                blobs.add_texts("cmp_heads_y", [f"L{layer}" for layer in layers]),
                zmin=0,
                zmax=top or 1.0,
                n_rows=len(layers),
                xtitle="head",
                ytitle="layer",
                hover="%{y}.%{x}<br>JS %{z:.4g}",
                zlabel="nats",
                variants=[
                    {"label": "mean over paired steps", "z": zm},
                    {"label": "max over paired steps", "z": blobs.add("cmp_heads_max", mx, "float32")},
                ],
            )
        )
    return sec


def compare_sections(cmp, blobs: Blobs) -> list[Section]:
    return [summary_section(cmp), pairs_section(cmp, blobs), layers_section(cmp, blobs)]
