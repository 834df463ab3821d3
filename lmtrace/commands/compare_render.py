"""How `lmtrace compare` shows a `Comparison`: the terminal summary (verdict, pairs, texts side by
side, the steps, layers and heads that changed most) and the markdown report written by --out."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _cmp_num(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def _cmp_prob(lp) -> str:
    return "not in top-k" if lp is None else f"{math.exp(lp):.3g}"


def _cmp_run_line(label: str, info: dict) -> str:
    g = info["generation"]
    parent = info.get("parent")
    if isinstance(parent, dict):
        parent = parent.get("run_id")
    return (
        f"{label} {info['run_id']} ({info['status']}): {info['model']}, T={g['temperature']} top_k={g['top_k']} "
        f"top_p={g['top_p']} seed={g['seed']} max_new_tokens={g['max_new_tokens']}"
        + (f", parent {parent}" if parent else "")
    )


def _cmp_pairing_line(cmp) -> str:
    p = cmp.pairing
    shown = ", ".join(f"A{a}↔B{b}" for a, b in p["pairs"][:8]) + (" …" if len(p["pairs"]) > 8 else "")
    line = f"pairing by {p['method']}: {len(p['pairs'])} pair(s) ({shown or 'none'})"
    if p["unpaired_a"] or p["unpaired_b"]:
        line += f"; unpaired: A {p['unpaired_a'] or '–'}, B {p['unpaired_b'] or '–'}"
    else:
        line += "; none unpaired"
    return line


def _cmp_divergence_cells(p: dict) -> tuple[str, str, str]:
    d = p["first_divergence"]
    if not p["same_prompt_ids"]:
        return "prompts differ", "", ""
    if d is None:
        return "none" + (" (in archived steps)" if p.get("note") else ""), "", ""
    cells = []
    for side, other in (("a", "b"), ("b", "a")):
        t = d[f"token_{side}"]
        if t is None:
            cells.append("(ended)")
        else:
            cells.append(
                f"{t['text']!r} p={_cmp_prob(t[f'logprob_under_{side}'])}, "
                f"under {other.upper()}: {_cmp_prob(t[f'logprob_under_{other}'])}"
            )
    return f"step {d['step']}", cells[0], cells[1]


def _cmp_chosen(r: dict) -> str:
    return repr(r["text_a"]) if r["token_a"] == r["token_b"] else f"{r['text_a']!r} / {r['text_b']!r}"


def _cmp_top_steps(cmp, top: int) -> list[dict]:
    """Paired steps with the largest JS (exact when --exact computed it, else over the stored top-k; non-zero)."""

    def js(r):
        return r.get("exact_js") if r.get("exact_js") is not None else r["js"]

    rows = [r for r in cmp.per_step.to_pylist() if js(r) is not None and js(r) > 0]
    return sorted(rows, key=lambda r: -js(r))[:top]


def _print_fitted(console: Console, title: str, headers: list[str], rows: list[list[str]], **how) -> None:
    """A table at the console's width (column_fit.print_fitted), the columns left out named in a line."""
    from ..output.column_fit import print_fitted

    print_fitted(console, headers, rows, complete_in="--json and --out have every figure", title=title, **how)


def render_comparison(cmp, console: Console | None = None, top: int = 5) -> None:
    """The terminal summary of a `Comparison` (lmtrace.analysis.compare): verdict, pairs, texts, the layers and heads that changed most."""
    if console is None:
        console = Console() if Console().is_terminal else Console(width=160, soft_wrap=True)
    _print_runs_and_verdict(cmp, console)
    if not cmp.pairs:
        return
    _print_pairs(cmp, console, top)
    _print_texts(cmp, console, top)
    exact = _print_steps(cmp, console, top)
    _print_layers_and_heads(cmp, console, top)
    _print_after_divergence(cmp, console)
    console.print(
        Text(
            "KL/JS: nats, over the tokens stored on both sides + one tail bucket (a lower bound of the "
            "full-vocabulary value"
            + (
                "; exact columns: full vocabulary, from the models"
                if exact
                else "; --exact computes it from the models"
            )
            + "); deltas are B − A; see docs/compare.md",
            style="dim",
        )
    )


def _print_runs_and_verdict(cmp, console: Console) -> None:
    """Both runs, how their specs differ, the tokenizer, the pairing and the verdict with its notes."""
    console.print(Text(_cmp_run_line("A", cmp.a)))
    console.print(Text(_cmp_run_line("B", cmp.b)))
    if cmp.spec_differences:
        diffs = "; ".join(f"{d['key']}: {d['a']} → {d['b']}" for d in cmp.spec_differences[:8])
        console.print(Text(f"differences: {diffs}" + (" …" if len(cmp.spec_differences) > 8 else "")))
    else:
        console.print(Text("differences: none in the resolved specs (model weights equal)", style="dim"))
    tok = cmp.compatibility["tokenizer"]
    console.print(
        Text(
            f"tokenizer: {tok['class_a']}, {tok['vocab_size']} tokens, "
            f"{tok['token_ids_cross_checked']} token texts cross-checked",
            style="dim",
        )
    )
    console.print(Text(_cmp_pairing_line(cmp)))
    console.print(Text(cmp.verdict, style="bold green" if cmp.identical else "bold yellow"))
    for note in cmp.notes:
        console.print(Text(f"note: {note}", style="dim"))


def _print_pairs(cmp, console: Console, top: int) -> None:
    """The table of sequence pairs (at least 10 shown)."""
    rows = []
    for p in cmp.pairs[: max(top, 10)]:
        f = p["paired_figures"] or {}
        where, ta, tb = _cmp_divergence_cells(p)
        rows.append(
            [
                str(p["pair"]),
                f"{p['seq_a']}↔{p['seq_b']}",
                where,
                ta,
                tb,
                str(p["paired_steps"]),
                _cmp_num(f.get("mean_kl_ab")),
                _cmp_num(f.get("max_js")),
                "–" if f.get("top1_agreement") is None else f"{f['top1_agreement']:.0%}",
            ]
        )
    _print_fitted(
        console,
        "sequence pairs (steps: paired steps, those with identical contexts, which the figures are "
        "over; top-1: how often the top tokens agree)",
        ["pair", "A↔B", "divergence", "A's token", "B's token", "steps", "KL(A‖B)", "max JS", "top-1"],
        rows,
        drop_first=("steps", "top-1", "max JS"),
        keep=("pair", "A↔B", "divergence", "A's token", "B's token"),
        left=("A↔B", "divergence"),
        wrap=("A's token", "B's token"),
        omit_empty=True,
    )
    if len(cmp.pairs) > max(top, 10):
        console.print(Text(f"… {len(cmp.pairs) - max(top, 10)} more pair(s) in --json / --out", style="dim"))


def _print_texts(cmp, console: Console, top: int) -> None:
    """The first pairs that diverge (or whose prompts differ), their texts side by side."""
    shown = [p for p in cmp.pairs if p["first_divergence"] is not None or not p["same_prompt_ids"]][: min(top, 3)]
    for p in shown:
        d = p["first_divergence"]
        title = f"pair {p['pair']}: texts side by side" + (" (▸ marks the divergence)" if d is not None else "")
        texts = Table(title=title, title_justify="left", show_lines=False, expand=True)
        texts.add_column("A", ratio=1, overflow="fold")
        texts.add_column("B", ratio=1, overflow="fold")
        common = Text(p["text"]["common"], style="dim") + Text("▸" if d is not None else "", style="bold")
        texts.add_row(common + Text(p["text"]["a"], style="cyan"), common + Text(p["text"]["b"], style="magenta"))
        console.print(texts)
        if d is not None and d.get("explanation"):
            console.print(Text(f"  step {d['step']}: {d['explanation']}", style="dim"))
        ld = p.get("step0_logit_diff")
        if ld is not None:
            console.print(
                Text(
                    f"  step-0 logit difference, A's {ld['text_a']!r} − B's {ld['text_b']!r}: under A "
                    f"{_cmp_num(ld['under_a'])}, under B {_cmp_num(ld['under_b'])} nats "
                    f"(– = a token outside that run's stored top-k)",
                    style="dim",
                )
            )


def _print_steps(cmp, console: Console, top: int) -> bool:
    """The steps whose distribution changed most; returns whether exact (--exact) figures are there."""
    steps = _cmp_top_steps(cmp, top)
    exact = any(r.get("exact_js") is not None for r in steps)
    if steps:
        cols = ["pair", "step", "chosen (A / B)", "JS ≥", "KL(A‖B) ≥"]
        cols += ["exact JS", "exact KL(A‖B)", "max |Δ logit|"] if exact else []
        cols += ["Δ entropy", "Δ margin", "top-1"]
        rows = [
            [
                str(r["pair"]),
                str(r["step"]),
                _cmp_chosen(r),
                _cmp_num(r["js"]),
                _cmp_num(r["kl_ab"]),
                *(
                    [
                        _cmp_num(r.get("exact_js")),
                        _cmp_num(r.get("exact_kl_ab")),
                        _cmp_num(r.get("exact_max_abs_logit_diff")),
                    ]
                    if exact
                    else []
                ),
                _cmp_num(r["entropy_delta"]),
                _cmp_num(r["margin_delta"]),
                "yes" if r["top1_agree"] else "no",
            ]
            for r in steps
        ]
        _print_fitted(
            console,
            "steps whose next-token distribution changed most (paired steps; JS ≥ and KL ≥: over "
            "the stored top-k, lower bounds; top-1: the top tokens agree)",
            cols,
            rows,
            drop_first=("top-1", "Δ margin", "Δ entropy", "KL(A‖B) ≥", "max |Δ logit|", "exact KL(A‖B)"),
            keep=("pair", "step", "chosen (A / B)", "exact JS" if exact else "JS ≥"),
            left=("chosen (A / B)",),
            wrap=("chosen (A / B)",),
        )
    return exact


def _print_layers_and_heads(cmp, console: Console, top: int) -> None:
    """The layers and the heads that changed most."""
    layers = [r for r in cmp.layers if r["changed"]][:top]
    if layers:
        rows = [
            [
                str(r["layer"]),
                _cmp_num(r["delta_norm_rel_change"]),
                _cmp_num(r["resid_norm_rel_change"]),
                _cmp_num(r["attn_js_mean"]),
                _cmp_num(r["lens_changes"]),
                _cmp_num(r["margin_contrib_abs_delta"]),
            ]
            for r in layers
        ]
        _print_fitted(
            console,
            f"layers that changed most (of {len(cmp.layers)}; paired steps; changes start at layer "
            f"{cmp.first_changed_layer}; Δ norms relative: of the layer's output and of the residual "
            f"stream after it)",
            ["layer", "Δ output norm", "Δ resid norm", "attn JS", "lens changes", "Δ margin"],
            rows,
            drop_first=("Δ margin", "lens changes"),
            keep=("layer", "Δ output norm"),
        )
    elif cmp.layers:
        console.print(
            Text(f"layers: no per-layer figure differs at any paired step ({len(cmp.layers)} layers)", style="green")
        )
    heads = [r for r in cmp.heads if r["attn_js_mean"] > 0][:top]
    if heads:
        rows = [[f"{r['layer']}.{r['q_head']}", _cmp_num(r["attn_js_mean"]), _cmp_num(r["attn_js_max"])] for r in heads]
        _print_fitted(
            console,
            f"heads that changed most (of {len(cmp.heads)}; attention-row JS, nats)",
            ["layer.head", "mean JS", "max JS"],
            rows,
            left=("layer.head",),
        )


def _print_after_divergence(cmp, console: Console) -> None:
    """Each side's mean logprob and entropy after the divergence (not paired)."""
    after = [
        p["after_divergence"]
        for p in cmp.pairs
        if p["after_divergence"] and (p["after_divergence"]["steps_a"] or p["after_divergence"]["steps_b"])
    ]
    if after:

        def avg(key):
            vals = [a[key] for a in after if a[key] is not None]
            return sum(vals) / len(vals) if vals else None

        console.print(
            Text(
                f"after divergence (per side, NOT paired: each side saw its own text): mean logprob A {_cmp_num(avg('mean_logprob_a'))} "
                f"/ B {_cmp_num(avg('mean_logprob_b'))}, mean entropy A {_cmp_num(avg('mean_entropy_a'))} "
                f"/ B {_cmp_num(avg('mean_entropy_b'))} nats",
                style="dim",
            )
        )


def _md_cell(x) -> str:
    """`x` as text safe inside a markdown table cell (pipes escaped, newlines shown as ⏎)."""
    return str(x).replace("|", "\\|").replace("\n", "⏎")


def _md_header(cmp) -> list[str]:
    """The report's title, the two runs, their spec differences, the pairing, the verdict and the notes."""
    lines = [
        "# lmtrace compare",
        "",
        f"- {_md_cell(_cmp_run_line('A', cmp.a))}",
        f"- {_md_cell(_cmp_run_line('B', cmp.b))}",
    ]
    if cmp.spec_differences:
        lines.append(
            "- differences: "
            + "; ".join(f"`{d['key']}`: {_md_cell(d['a'])} → {_md_cell(d['b'])}" for d in cmp.spec_differences)
        )
    lines += [f"- {_md_cell(_cmp_pairing_line(cmp))}", "", f"**{_md_cell(cmp.verdict)}**", ""]
    lines += [f"> note: {_md_cell(n)}" for n in cmp.notes]
    return lines


def _md_pairs(cmp) -> list[str]:
    """The sequence-pairs table, then the text of every pair that diverges or was prompted differently."""
    lines = [
        "",
        "## Sequence pairs",
        "",
        "| pair | A↔B | first divergence | A's token | B's token | paired steps | mean KL(A‖B) | max JS | top-1 agree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in cmp.pairs:
        f = p["paired_figures"] or {}
        where, ta, tb = _cmp_divergence_cells(p)
        agree = "–" if f.get("top1_agreement") is None else f"{f['top1_agreement']:.0%}"
        lines.append(
            f"| {p['pair']} | {p['seq_a']}↔{p['seq_b']} | {_md_cell(where)} | {_md_cell(ta)} | {_md_cell(tb)} | "
            f"{p['paired_steps']} | {_cmp_num(f.get('mean_kl_ab'))} | {_cmp_num(f.get('max_js'))} | {agree} |"
        )
    for p in cmp.pairs:
        if p["first_divergence"] is None and p["same_prompt_ids"]:
            continue
        d = p["first_divergence"]
        lines += ["", f"### Pair {p['pair']}" + (f" — diverges at step {d['step']}" if d else ""), ""]
        if d and d.get("explanation"):
            lines += [_md_cell(d["explanation"]), ""]
        lines += [
            "| | text |",
            "|---|---|",
            f"| shared | {_md_cell(p['text']['common'])} |",
            f"| A | {_md_cell(p['text']['a'])} |",
            f"| B | {_md_cell(p['text']['b'])} |",
        ]
    return lines


def _md_steps(cmp, top: int) -> list[str]:
    """The table of the `top` steps whose next-token distribution changed most (nothing when none)."""
    steps = _cmp_top_steps(cmp, top)
    if not steps:
        return []
    lines = [
        "",
        "## Steps whose next-token distribution changed most",
        "",
        "| pair | step | chosen (A / B) | JS | KL(A‖B) | Δ entropy | Δ margin | top-1 agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        lines.append(
            f"| {r['pair']} | {r['step']} | {_md_cell(_cmp_chosen(r))} | {_cmp_num(r['js'])} | {_cmp_num(r['kl_ab'])} | "
            f"{_cmp_num(r['entropy_delta'])} | {_cmp_num(r['margin_delta'])} | {'yes' if r['top1_agree'] else 'no'} |"
        )
    return lines


def _md_layers(cmp, top: int) -> list[str]:
    """The per-layer table of the first `top` layers, headed by where changes start (nothing without layers)."""
    if not cmp.layers:
        return []
    start = (
        "no layer changed" if cmp.first_changed_layer is None else f"changes start at layer {cmp.first_changed_layer}"
    )
    lines = [
        "",
        f"## Layers (paired steps; {start})",
        "",
        "| layer | Δ layer-output norm (rel) | Δ resid norm (rel) | attn JS mean | lens winner changes | Δ margin contrib |",
        "|---|---|---|---|---|---|",
    ]
    for r in cmp.layers[:top]:
        lines.append(
            f"| {r['layer']} | {_cmp_num(r['delta_norm_rel_change'])} | {_cmp_num(r['resid_norm_rel_change'])} | "
            f"{_cmp_num(r['attn_js_mean'])} | {_cmp_num(r['lens_changes'])} | "
            f"{_cmp_num(r['margin_contrib_abs_delta'])} |"
        )
    return lines


def _md_heads(cmp, top: int) -> list[str]:
    """The `top` heads whose attention rows differ, or a line saying none does (nothing without heads)."""
    heads = [r for r in cmp.heads if r["attn_js_mean"] > 0]
    lines = []
    if cmp.heads and not heads:
        lines += ["", "## Heads", "", f"No attention row differs at any paired step ({len(cmp.heads)} heads)."]
    if heads:
        lines += ["", "## Heads (attention-row JS, nats)", "", "| layer.head | mean JS | max JS |", "|---|---|---|"]
        for r in heads[:top]:
            lines.append(
                f"| {r['layer']}.{r['q_head']} | {_cmp_num(r['attn_js_mean'])} | {_cmp_num(r['attn_js_max'])} |"
            )
    return lines


def comparison_markdown(cmp, top: int = 10) -> str:
    """A small markdown report of a `Comparison` (lmtrace.analysis.compare) (written as report.md by --out)."""
    lines = _md_header(cmp) + _md_pairs(cmp) + _md_steps(cmp, top) + _md_layers(cmp, top) + _md_heads(cmp, top)
    lines += [
        "",
        "KL/JS are in nats over the tokens stored on both sides plus one tail bucket (lower bounds of the "
        "full-vocabulary values); deltas are B − A; figures after a divergence are per side and not paired. "
        "Tables: per_step.parquet, per_layer.parquet, per_head.parquet, pairs.parquet. Definitions: docs/compare.md.",
        "",
    ]
    return "\n".join(lines)
