"""The sections of a run's report, each built from the archive alone (no model is loaded).

Each builder returns a `Section`; a section whose data the run lacks says in one line what to
capture (or which command to run) instead. Figures reference their numbers through `Blobs`.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import numpy as np
import yaml

from ..archive.effects import has_effects, read_effects
from ..archive.layout import EFFECTS
from ..output.prob_colours import page_colour
from . import figures as F
from .blobs import Blobs
from .run_data import RunData, display, stack_steps, token_prob
from .selection import Selection


@dataclass
class Section:
    id: str
    title: str
    html: str = ""
    figures: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def key_labels(texts: list[str]) -> list[str]:
    """Unique axis labels for key positions: 'position:token'."""
    return [f"{p}:{display(t)}" for p, t in enumerate(texts)]


def step_labels(steps: list[int], gen_texts: list[str]) -> list[str]:
    return [f"s{s}:{display(gen_texts[s]) if s < len(gen_texts) else ''}" for s in steps]


def shown_sequences(data: RunData, sel: Selection):
    """(sequence, steps shown, its tokens) for each selected sequence with readable steps."""
    for seq in sel.sequences:
        if sel.steps[seq]:
            yield seq, sel.steps[seq], data.tokens(seq)


# ---- manifest ----------------------------------------------------------------------------------
def manifest_section(data: RunData) -> Section:
    m = data.manifest
    model = m.get("model") or {}
    gen = (m.get("spec_resolved") or {}).get("generation") or {}
    timings = m.get("timings") or {}
    rows = [
        ("run", m.get("run_id")),
        ("kind", m.get("kind")),
        ("status", m.get("status")),
        ("created", m.get("created")),
        ("ended", m.get("completed") or m.get("ended")),
        ("model", f"{model.get('reference')} ({model.get('class')}, {model.get('architecture_family') or '?'})"),
        ("weights sha256", (model.get("weights_sha256") or "")[:16]),
        (
            "tokenizer",
            f"{(m.get('tokenizer') or {}).get('class')}, {(m.get('tokenizer') or {}).get('vocab_size')} tokens",
        ),
        ("device / dtype", f"{m.get('device')} / {m.get('dtype')}"),
        ("attention kernel", (m.get("attention") or {}).get("kernel")),
        ("seed", m.get("seed")),
        (
            "generation",
            ", ".join(f"{k}={gen.get(k)}" for k in ("max_new_tokens", "temperature", "top_k", "top_p") if k in gen),
        ),
        ("prompts / tokens", f"{m.get('n_prompts')} / {m.get('n_generated_tokens')}"),
        ("captured layers", len((m.get("shape") or {}).get("layers") or [])),
        ("arrays", ", ".join(m.get("arrays") or {}) or "none"),
        ("logit lens", data.lens_state),
        (
            "timings",
            ", ".join(f"{k} {v:.3g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in timings.items()),
        ),
    ]
    parent = m.get("parent")
    if parent:
        rows.append(("parent", parent.get("run_id") if isinstance(parent, dict) else parent))
    if m.get("error"):
        rows.append(("error", m["error"]))
    body = "<table class='kv'>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows) + "</table>"
    spec = m.get("spec_given") or m.get("spec_resolved")
    if spec:
        text = spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False)
        body += f"<details><summary>spec</summary><pre>{esc(text)}</pre></details>"
    return Section("manifest", "Run", body)


# ---- generated text --------------------------------------------------------------------------
def prob_colour(p: float) -> str:
    """Orange (unlikely) through near-white to blue (confident): colour-blind safe, light enough to read text on."""
    return page_colour(p)


def _rank_1(rank):
    """The archive's rank (0 = top-1) counted from 1, as every view shows it; None stays None."""
    return None if rank is None or (isinstance(rank, float) and not math.isfinite(rank)) else int(rank) + 1


def _token_info(data: RunData, g: dict, s: int, alt_texts: list[str]) -> str:
    lp = g["logprob"][s]
    lines = [
        f"{display(g['token_text'][s])!r}  step {s}  (id {g['token_id'][s]})",
        f"p = {fmt(g['prob'][s], 4)}   logprob = {fmt(lp, 4)}   rank {fmt(_rank_1(g['token_rank'][s]))} (1 = top-1)",
        f"top-1 − top-2 margin {fmt(g['margin'][s])} nats   stability {g['stability'][s]}   "
        f"entropy {fmt(g['entropy'][s])} nats",
    ]
    sp = g.get("sampling_prob", [None] * (s + 1))[s]
    if sp is not None and sp != 1.0:
        lines.append(
            f"sampled with p = {fmt(sp, 4)} (after temperature/top-k/top-p), {fmt(g['eligible'][s])} eligible tokens"
        )
    fc = g.get("filter_changed", [None] * (s + 1))[s]
    if fc is not None:
        lines.append("top-k/top-p changed the choice: " + ("yes" if fc else "no"))
    alts = g.get("alt_logprobs", [None] * (s + 1))[s] or []
    if alt_texts:
        lines.append(
            "alternatives: " + " · ".join(f"{display(t)!r} {math.exp(a):.3g}" for t, a in zip(alt_texts, alts))
        )
    return "\n".join(lines)


def text_section(data: RunData, sel: Selection) -> Section:
    sec = Section("text", "Generated text")
    parts = [
        "<p class='legend'>Each generated token is coloured by its probability "
        "(<span class='tok' style='background:" + prob_colour(0.05) + "'>p≈0</span> → "
        "<span class='tok' style='background:" + prob_colour(0.5) + "'>0.5</span> → "
        "<span class='tok' style='background:" + prob_colour(1.0) + "'>1</span>); "
        "hover a token for its statistics and alternatives, click it to open its step in the token view "
        "(where the run has internals). The prompt is grey.</p>"
    ]
    seq_rows = {r["sequence"]: r for r in data.sequences}
    for seq in sel.sequences:
        tok = data.tokens(seq)
        g = tok.gen
        meta = seq_rows.get(seq, {})
        parts.append(
            f"<h3>sequence {seq} <small>{tok.n_steps} tokens"
            + (f", stop: {esc(meta.get('stop_reason'))}" if meta.get("stop_reason") else "")
            + "</small></h3><div class='strip' data-seq='"
            + str(seq)
            + "'>"
        )
        parts.append(
            "".join(f"<span class='ptok' title='position {p}'>{esc(t)}</span>" for p, t in enumerate(tok.prompt_texts))
        )
        alt_ids = g.get("alt_ids", [])
        flat = [i for ids in alt_ids for i in (ids or [])]
        flat_texts = data.run.text(flat) if flat else []
        k = 0
        for s in range(tok.n_steps):
            n_alt = len(alt_ids[s] or []) if alt_ids else 0
            alt_texts = flat_texts[k : k + n_alt]
            k += n_alt
            p = g["prob"][s]
            p = token_prob(g["logprob"][s]) if p is None else float(p)
            info = _token_info(data, g, s, alt_texts)
            parts.append(
                f"<span class='tok' style='background:{prob_colour(p)}' data-seq='{seq}' data-step='{s}' "
                f"data-prob='{p!r}' title='{esc(info)}'>{esc(g['token_text'][s])}</span>"
            )
        parts.append("</div>")
    parts.append("<pre class='tokinfo' id='tokinfo'>hover a generated token</pre>")
    sec.html = "".join(parts)
    return sec


# ---- logit lens ------------------------------------------------------------------------------
def lens_section(data: RunData, sel: Selection, blobs: Blobs) -> Section:
    sec = Section("lens", "Logit lens")
    if data.lens_state == "pending":
        sec.notes.append(
            f"the logit lens is deferred and not computed yet: run `lmtrace lens {data.run.id}`, "
            f"then `lmtrace report {data.run.id}` again"
        )
        return sec
    if data.lens_state == "none" or "lens_ids" not in data.arrays:
        sec.notes.append("no logit lens was captured: set `capture.lens.enabled: true`")
        return sec
    layers = data.layers
    ylabels = blobs.add_texts("lens_layers", [f"L{layer}" for layer in layers])
    for seq, steps, tok in shown_sequences(data, sel):
        ids = stack_steps(data, "lens_ids", seq, steps)  # [step, layer, k]
        probs = stack_steps(data, "lens_probs", seq, steps).astype(np.float32)
        n, L, k = ids.shape
        texts = np.asarray(data.run.text(ids.ravel().tolist()), dtype=object).reshape(ids.shape)
        chosen = np.asarray([tok.gen["token_id"][s] for s in steps])
        hit = ids == chosen[:, None, None]
        rank = np.where(hit.any(axis=2), hit.argmax(axis=2), -1)  # [step, layer]
        chosen_p = np.where(rank >= 0, np.take_along_axis(probs, np.maximum(rank, 0)[..., None], 2)[..., 0], np.nan)
        custom = np.empty((L, n), dtype=object)
        for i in range(n):
            ct = display(tok.gen["token_text"][steps[i]])
            for j in range(L):
                tops = "<br>".join(f"{esc(display(texts[i, j, r]))} {probs[i, j, r]:.3f}" for r in range(k))
                where = (
                    f"chosen {esc(ct)!s}: rank {rank[i, j] + 1}, p {chosen_p[i, j]:.3f}"
                    if rank[i, j] >= 0
                    else f"chosen {esc(ct)}: not in the lens top-{k}"
                )
                custom[j, i] = tops + "<br>" + where
        top1_text = np.vectorize(lambda t: display(t)[:8])(texts[:, :, 0].T)
        xlabels = blobs.add_texts(f"lens_steps_{seq}", step_labels(steps, tok.gen["token_text"]))
        z = blobs.add(f"lens_top1_prob_{seq}", probs[:, :, 0].T, "float32")
        zc = blobs.add(f"lens_chosen_prob_{seq}", chosen_p.T, "float32")
        text = blobs.add(f"lens_top1_text_{seq}", top1_text.astype(object))
        rank_text = blobs.add(
            f"lens_chosen_rank_{seq}",
            np.where(rank.T >= 0, np.char.add("#", (rank.T + 1).astype(str)), "–").astype(object),
        )
        cd = blobs.add(f"lens_custom_{seq}", custom)
        sec.figures.append(
            F.heatmap(
                f"lens-{seq}",
                f"sequence {seq}: logit lens — each layer's top-1 token and its probability",
                z,
                xlabels,
                ylabels,
                text=text,
                customdata=cd,
                n_rows=L,
                n_cols=n,
                cell_px=52,
                xtitle="step:chosen token",
                ytitle="layer",
                hover="%{y} · %{x}<br>%{customdata}",
                zlabel="probability",
                variants=[
                    {"label": "top-1 token, its probability", "z": z, "text": text},
                    {"label": "the finally chosen token: its lens rank and probability", "z": zc, "text": rank_text},
                ],
            )
        )
    return sec


# ---- per-layer figures ---------------------------------------------------------------------------
NORMS = (
    ("resid_norm", "residual norm after the layer"),
    ("delta_norm", "layer's change to the residual"),
    ("attn_norm", "attention output"),
    ("mlp_norm", "MLP output"),
)


def layers_section(data: RunData, sel: Selection, blobs: Blobs) -> Section:
    sec = Section("layers", "Per-layer norms and margin contributions")
    if not data.has_steps:
        sec.notes.append("no per-layer statistics: the run was forward-only (`capture: none`)")
        return sec
    for seq in sel.sequences:
        cols = data.step_columns(seq)
        steps = set(sel.steps[seq])
        if cols is None or not steps:
            continue
        keep = np.isin(cols["step"], list(steps))
        layer = cols["layer"][keep]
        order = sorted(set(layer.tolist()))
        x = blobs.add(f"layers_x_{seq}", np.asarray(order, dtype=np.int32))
        series = []
        for name, label in NORMS:
            if name not in cols:
                continue
            v = cols[name][keep].astype(np.float64)
            means = np.asarray(
                [np.nanmean(v[layer == li]) if np.isfinite(v[layer == li]).any() else np.nan for li in order]
            )
            if np.isfinite(means).any():
                series.append({"name": label, "x": x, "y": blobs.add(f"layers_{name}_{seq}", means, "float32")})
        if series:
            sec.figures.append(
                F.lines(
                    f"norms-{seq}",
                    f"sequence {seq}: L2 norms per layer (mean over the {len(steps)} steps shown)",
                    series,
                    xtitle="layer",
                    ytitle="L2 norm",
                    ylog=True,
                )
            )
        if "margin_contrib" in cols and np.isfinite(cols["margin_contrib"][keep].astype(float)).any():
            step_list = sorted(steps)
            grid = np.full((len(order), len(step_list)), np.nan, dtype=np.float32)
            col = {s: i for i, s in enumerate(step_list)}
            row = {li: i for i, li in enumerate(order)}
            for li, s, v in zip(layer, cols["step"][keep], cols["margin_contrib"][keep]):
                grid[row[int(li)], col[int(s)]] = v
            lim = float(np.nanmax(np.abs(grid))) or 1.0
            tok = data.tokens(seq)
            sec.figures.append(
                F.heatmap(
                    f"margin-{seq}",
                    f"sequence {seq}: each layer's share of the final top-1 − top-2 logit margin "
                    "(through the final norm at its actual scale; with the embedding's share they sum to the margin)",
                    blobs.add(f"margin_contrib_{seq}", grid, "float32"),
                    blobs.add_texts(f"margin_steps_{seq}", step_labels(step_list, tok.gen["token_text"])),
                    blobs.add_texts(f"margin_layers_{seq}", [f"L{li}" for li in order]),
                    zmin=-lim,
                    zmax=lim,
                    colorscale=F.DIVERGING,
                    n_rows=len(order),
                    n_cols=len(step_list),
                    cell_px=14,
                    xtitle="step:chosen token",
                    ytitle="layer",
                    hover="%{y} · %{x}<br>%{z:.3f} logits",
                    zlabel="logits",
                )
            )
            means = np.nanmean(grid, axis=1)
            sec.figures.append(
                F.lines(
                    f"margin-mean-{seq}",
                    f"sequence {seq}: mean margin contribution per layer",
                    [{"name": "mean over steps", "x": x, "y": blobs.add(f"margin_mean_{seq}", means, "float32")}],
                    xtitle="layer",
                    ytitle="logits",
                )
            )
    return sec


# ---- mixture of experts ----------------------------------------------------------------------
def router_section(data: RunData, sel: Selection, blobs: Blobs) -> Section | None:
    if "router_topk_idx" not in data.arrays:
        return None
    sec = Section("router", "Mixture-of-experts routing")
    layers = data.layers
    for seq, steps, tok in shown_sequences(data, sel):
        idx = stack_steps(data, "router_topk_idx", seq, steps)  # [step, layer, k]
        w = stack_steps(data, "router_topk_weight", seq, steps).astype(np.float32)
        top = np.where(idx[:, :, 0] >= 0, idx[:, :, 0], np.nan).astype(np.float32).T  # [layer, step]
        text = np.empty(top.shape, dtype=object)
        custom = np.empty(top.shape, dtype=object)
        for i in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                chosen = [(int(e), float(x)) for e, x in zip(idx[i, j], w[i, j]) if e >= 0]
                text[j, i] = ",".join(str(e) for e, _ in chosen) if chosen else ""
                custom[j, i] = "<br>".join(f"expert {e}: weight {x:.3f}" for e, x in chosen) or "dense layer"
        n_exp = float(np.nanmax(top)) if np.isfinite(top).any() else 1.0
        t = blobs.add(f"router_text_{seq}", text)
        c = blobs.add(f"router_custom_{seq}", custom)
        sec.figures.append(
            F.heatmap(
                f"router-{seq}",
                f"sequence {seq}: experts chosen per layer and step (colour: the top-1 expert)",
                blobs.add(f"router_top1_{seq}", top, "float32"),
                blobs.add_texts(f"router_steps_{seq}", step_labels(steps, tok.gen["token_text"])),
                blobs.add_texts(f"router_layers_{seq}", [f"L{layer}" for layer in layers]),
                zmin=0,
                zmax=max(1.0, n_exp),
                colorscale="Turbo",
                text=t,
                customdata=c,
                n_rows=len(layers),
                n_cols=len(steps),
                cell_px=40,
                xtitle="step:chosen token",
                ytitle="layer",
                hover="%{y} · %{x}<br>%{customdata}",
                zlabel="expert",
            )
        )
    return sec


# ---- intervention children ---------------------------------------------------------------------
def intervention_section(data: RunData, sel: Selection, blobs: Blobs) -> Section | None:
    m = data.manifest
    if m.get("kind") != "intervene" and not has_effects(data.run):
        return None
    parent = m.get("parent") or {}
    sec = Section("intervention", "Intervention: parent vs child")
    listed = yaml.safe_dump(m.get("interventions") or [], sort_keys=False).strip()
    sec.html = (
        f"<p>parent <code>{esc(parent.get('run_id') if isinstance(parent, dict) else parent)}</code>, "
        f"mode <b>{esc(m.get('mode'))}</b>, edits from step {esc(m.get('from_step'))}"
        f" (first edited step {esc(m.get('first_edited_step'))})</p><pre>{esc(listed)}</pre>"
    )
    effects = read_effects(data.run)
    if effects is None:
        sec.notes.append(f"this child has no {EFFECTS} (it was interrupted before finishing)")
        return sec
    eff = effects.to_pydict()
    rows_html = []
    for seq in sel.sequences:
        idx = [i for i, s in enumerate(eff["sequence"]) if s == seq]
        idx.sort(key=lambda i: eff["step"][i])
        if not idx:
            continue
        steps = [eff["step"][i] for i in idx]
        shift = [eff["logprob_shift"][i] for i in idx]
        x = blobs.add(f"effects_steps_{seq}", np.asarray(steps, dtype=np.int32))
        y = blobs.add(f"effects_shift_{seq}", np.asarray([np.nan if v is None else v for v in shift]), "float32")
        changed = [i for i in idx if eff["winner_changed"][i]]
        series = [{"name": "logprob shift of the parent's token (child − parent)", "x": x, "y": y}]
        if changed:
            series.append(
                {
                    "name": "winner changed",
                    "x": blobs.add(f"effects_changed_x_{seq}", np.asarray([eff["step"][i] for i in changed], np.int32)),
                    "y": blobs.add(
                        f"effects_changed_y_{seq}",
                        np.asarray(
                            [np.nan if eff["logprob_shift"][i] is None else eff["logprob_shift"][i] for i in changed]
                        ),
                        "float32",
                    ),
                    "color": "#d62728",
                }
            )
        fig = F.lines(
            f"effects-{seq}",
            f"sequence {seq}: effect of the interventions per step",
            series,
            xtitle="step",
            ytitle="nats",
        )
        if len(series) > 1:
            fig["data"][1]["mode"] = "markers"
            fig["data"][1]["marker"] = {"size": 10, "symbol": "x"}
        sec.figures.append(fig)
        ids = [t for i in changed for t in (eff["parent_top1"][i], eff["child_top1"][i])]
        texts = data.run.text(ids) if ids else []
        for n, i in enumerate(changed[:50]):
            rows_html.append(
                f"<tr><td>{seq}</td><td>{eff['step'][i]}</td><td>{esc(display(texts[2 * n]))}</td>"
                f"<td>{esc(display(texts[2 * n + 1]))}</td><td>{fmt(eff['parent_logprob'][i])}</td>"
                f"<td>{fmt(eff['child_logprob_of_parent_token'][i])}</td></tr>"
            )
    if rows_html:
        sec.html += (
            "<table class='grid'><tr><th>sequence</th><th>step</th><th>parent's top-1</th>"
            "<th>child's top-1</th><th>parent logprob</th><th>child logprob of parent's token</th></tr>"
            + "".join(rows_html)
            + "</table>"
        )
    else:
        sec.html += "<p>no step's winner changed in the sequences shown.</p>"
    return sec


def banner(data: RunData, sel: Selection) -> str:
    status = data.run.status
    if status == "complete":
        return ""
    shown = ", ".join(f"sequence {s}: {sel.available[s]} steps" for s in sel.sequences)
    return (
        f"<div class='banner'>This run is <b>{esc(status)}</b>, not complete: the report shows its committed "
        f"steps only ({esc(shown)}).</div>"
    )
