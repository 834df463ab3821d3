"""What `lmtrace explain` prints: the rich terminal view of an `ExplainResult` (context coloured by
score, top positions) and its JSON summary. A helper of the explain command, not a command."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..analysis.attribution import METHODS, ig_shortfall, method_of, result_shortfall
from ..analysis.attribution.integrated_gradients import percent
from ..output.jsonout import strict

if TYPE_CHECKING:
    from .explain import ExplainResult


def _show_token(text: str) -> str:
    return text.replace("\n", "⏎").replace("\t", "⇥") or "∅"


def _background(score: float, scale: float) -> str:
    """White for 0, towards green for positive and red for negative relevance (|score| / scale)."""
    x = 0.0 if scale <= 0 or not math.isfinite(score) else max(-1.0, min(1.0, score / scale))
    fade = int(round(255 * (1 - abs(x) * 0.85)))
    if x >= 0:
        return f"black on rgb({fade},255,{fade})"
    return f"black on rgb(255,{fade},{fade})"


def _top(scores: np.ndarray, top: int) -> np.ndarray:
    """Positions of the `top` largest |score| (NaN last), stable."""
    return np.argsort(-np.nan_to_num(np.abs(scores), nan=-1.0), kind="stable")[:top]


def _print_heading(console, e, s) -> None:
    """The rule naming the sequence, step and method, then the target token, runner-up and what is scored."""
    from rich.text import Text

    m = METHODS[method_of(e.method)]
    what = f"{s.target} ({s.quantity})" if m.needs_model else "rollout share of the last position"
    console.rule(f"sequence {e.sequence} step {e.step}: {e.method}")
    head = Text("target token ")
    head.append(repr(e.target_text), style="bold")
    head.append(f" (id {e.chosen_id})")
    if m.needs_model:
        head.append("; runner-up ")
        head.append(repr(e.runner_up_text), style="bold")
        head.append(f" (id {e.runner_up_id})")
    head.append(f"; scoring {what}")
    console.print(head)


def _print_facts(console, e) -> None:
    """The explanation's numbers (f(x), sums, errors, log-probabilities) that it has, on one dim line."""
    from rich.text import Text

    facts = []
    for key in (
        "f_x",
        "f_baseline",
        "sum_scores",
        "completeness_error",
        "bias_relevance",
        "sum_latents",
        "sum_error",
        "sum_inputs",
        "conservation_error",
        "recomputed_logprob",
        "archived_logprob",
    ):
        if key in e.info and e.info[key] is not None:
            facts.append(f"{key}={e.info[key]:.4g}")
    if facts:
        console.print(Text("  ".join(facts), style="dim"))


def _print_checks(console, e, s) -> None:
    """Whether integrated gradients converged / the method conserved, and the top heads where scored."""
    from rich.text import Text

    if "converged" in e.info:
        rel = e.info.get("completeness_error_relative")
        if e.info["converged"]:
            console.print(
                Text(
                    f"converged: completeness error {percent(rel)} ≤ {s.ig_tolerance:.0%} of "
                    f"|f(x) − f(baseline)| ({e.info.get('gradient_points')} gradient points)",
                    style="dim",
                )
            )
        else:
            console.print(
                Text(
                    f"NOT CONVERGED: {ig_shortfall(e.info, s.ig_tolerance)}; see docs/explain.md, "
                    f"'When a result did not converge'",
                    style="bold yellow",
                )
            )
    if "conserved" in e.info:
        rel, tol = e.info.get("conservation_error_relative"), e.info.get("conservation_tolerance")
        what = "latents + error node + inputs + bias relevance" if e.latents else "Σ scores + bias relevance"
        if e.info["conserved"]:
            console.print(Text(f"conserved: f = {what} to a relative error of {rel:.1e} ≤ {tol:g}", style="dim"))
        else:
            why = result_shortfall(e.method, e.info, s) or ""
            console.print(Text(f"NOT CONSERVED: {why.removeprefix('does not conserve: ')}", style="bold yellow"))
    if "heads" in e.components:
        tops = ", ".join(f"L{h['layer']}.H{h['head']} {h['relevance']:+.3g}" for h in top_heads(e.components, 5))
        console.print(Text(f"top heads by |relevance|: {tops}", style="dim"))


def _print_context(console, e) -> None:
    """The context coloured by score (generated tokens underlined), then the target token."""
    from rich.text import Text

    finite = np.abs(e.scores[np.isfinite(e.scores)])
    scale = float(finite.max()) if finite.size else 0.0
    text = Text()
    for i, (tok, sc) in enumerate(zip(e.token_texts, e.scores)):
        style = _background(float(sc), scale)
        if not e.is_prompt[i]:
            style += " underline"
        text.append(_show_token(tok), style=style)
    text.append(" → ", style="dim")
    text.append(_show_token(e.target_text), style="bold reverse")
    console.print(text)


def _print_top_positions(console, e, top: int) -> None:
    """The table of the `top` positions by |score| with each one's share of the total |score|."""
    from rich.table import Table
    from rich.text import Text

    order = _top(e.scores, top)
    what = " (latents + error node at the position)" if e.latents else ""
    table = Table(title=f"top {len(order)} positions by |score|{what}", show_edge=False, title_justify="left")
    for col, just in (("#", "right"), ("position", "right"), ("token", "left"), ("score", "right"), ("share", "right")):
        table.add_column(col, justify=just)
    denom = float(np.nansum(np.abs(e.scores))) or 1.0
    for rank, i in enumerate(order):
        sc = float(e.scores[i])
        table.add_row(
            str(rank + 1),
            str(int(i)) + ("" if e.is_prompt[i] else "*"),
            repr(e.token_texts[i]),
            Text(f"{sc:+.4g}", style="green" if sc >= 0 else "red"),
            f"{abs(sc) / denom:.0%}",
        )
    console.print(table)


def top_latents(e, top: int) -> list[dict]:
    """The `top` (position, latent) pairs of an SAE result by |attribution|, and each position's error node."""
    ids = np.asarray(e.latents["ids"])
    scores = np.asarray(e.latents["scores"], dtype=np.float64)
    flat = np.argsort(-np.nan_to_num(np.abs(scores), nan=-1.0), axis=None, kind="stable")[:top]
    out = []
    for k in flat:
        p, j = divmod(int(k), ids.shape[1])
        if ids[p, j] < 0:
            break
        out.append({"feature": int(ids[p, j]), "position": p, "token": e.token_texts[p], "score": float(scores[p, j])})
    return out


def _print_latents(console, e, top: int) -> None:
    """An SAE result's table: its top latents by |attribution| (feature id, position, token), then the error
    node's share."""
    from rich.table import Table
    from rich.text import Text

    rows = top_latents(e, top)
    table = Table(title=f"top {len(rows)} SAE latents by |attribution|", show_edge=False, title_justify="left")
    for col, just in (
        ("#", "right"),
        ("feature", "right"),
        ("position", "right"),
        ("token", "left"),
        ("score", "right"),
    ):
        table.add_column(col, justify=just)
    for rank, r in enumerate(rows):
        p = r["position"]
        table.add_row(
            str(rank + 1),
            str(r["feature"]),
            str(p) + ("" if e.is_prompt[p] else "*"),
            repr(r["token"]),
            Text(f"{r['score']:+.4g}", style="green" if r["score"] >= 0 else "red"),
        )
    console.print(table)
    error = np.asarray(e.latents["error"], dtype=np.float64)
    worst = int(np.argmax(np.abs(error))) if error.size else 0
    console.print(
        Text(
            f"error node: Σ {float(error.sum()):+.4g} over positions (largest at position {worst}, "
            f"{float(error[worst]) if error.size else 0.0:+.4g}); latents Σ {e.info.get('sum_latents', 0.0):+.4g}",
            style="dim",
        )
    )


def render(result: "ExplainResult", console=None, top: int = 10) -> None:
    """Print an `ExplainResult`: per explanation its heading, figures, checks, coloured context and top positions."""
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    s = result.settings
    console.print(f"[bold]explain {result.explain_id}[/bold] of run {result.run_id} -> {result.path}")
    for e in result.explanations:
        _print_heading(console, e, s)
        _print_facts(console, e)
        _print_checks(console, e, s)
        _print_context(console, e)
        _print_top_positions(console, e, top)
        if e.latents:
            _print_latents(console, e, top)
    console.print(Text(legend(console.color_system is not None), style="dim"))


def legend(colour: bool) -> str:
    """The key to what `render` printed: colours only where the console shows them (not piped, not NO_COLOR)."""
    if colour:
        return "background: green = supports the target, red = opposes it; underlined / * = generated token"
    return "score sign: + supports the target, − opposes it; * after a position = generated token"


def summary(result: "ExplainResult", top: int = 10) -> dict:
    """The `--json` summary: ids, manifest entries, notes, convergence, the methods' own checks and the top
    positions per step and method."""
    out = {
        "explain_id": result.explain_id,
        "run_id": result.run_id,
        "path": str(result.path),
        "entries": result.entries,
        "notes": result.notes,
        "converged": converged(result),
        "checks_passed": checks_passed(result),
        "top": [],
    }
    for e in result.explanations:
        order = _top(e.scores, top)
        item = {
            "method": e.method,
            "sequence": e.sequence,
            "step": e.step,
            "positions": [{"position": int(i), "token": e.token_texts[i], "score": float(e.scores[i])} for i in order],
        }
        for key in (
            "converged",
            "completeness_error",
            "completeness_error_relative",
            "error_bound_relative",
            "bias_relevance",
            "conservation_error",
            "conservation_error_relative",
            "conserved",
            "sum_latents",
            "sum_error",
            "sum_inputs",
        ):
            if key in e.info:
                item[key] = e.info[key]
        if e.latents:  # attribution to an SAE: its top latents
            item["latents"] = top_latents(e, top)
        if METHODS[method_of(e.method)].shortfall is not None:  # the method's own check: passed, or what failed
            failed = result_shortfall(e.method, e.info, result.settings)
            item["check_passed"] = failed is None
            if failed is not None:
                item["check_failed"] = f"{e.method} {failed}"
        if "heads" in e.components:  # lrp: relevance per layer's attention and MLP output, and the top heads
            item["components"] = {
                "attention": [float(x) for x in e.components["attention"]],
                "mlp": [float(x) for x in e.components["mlp"]],
                "top_heads": top_heads(e.components, top),
            }
        out["top"].append(item)
    return strict(out)


def top_heads(components: dict, top: int) -> list[dict]:
    """The `top` heads by |relevance| of an lrp result's components["heads"] [layer, head]."""
    heads = np.asarray(components["heads"], dtype=np.float64)
    order = np.argsort(-np.abs(heads), axis=None, kind="stable")[:top]
    return [
        {"layer": int(i // heads.shape[1]), "head": int(i % heads.shape[1]), "relevance": float(heads.flat[i])}
        for i in order
    ]


def failed_checks(result: "ExplainResult") -> list[str]:
    """`sequence S step T: METHOD <what failed>` for every result whose method's own check failed."""
    out = []
    for e in result.explanations:
        failed = result_shortfall(e.method, e.info, result.settings)
        if failed is not None:
            out.append(f"sequence {e.sequence} step {e.step}: {e.method} {failed}")
    return out


def checks_passed(result: "ExplainResult") -> bool | None:
    """False if any result failed its method's own check (IG completeness, lrp conservation); None if no
    method run has a check."""
    if not any(METHODS[method_of(e.method)].shortfall is not None for e in result.explanations):
        return None
    return not failed_checks(result)


def converged(result: "ExplainResult") -> bool | None:
    """False if any integrated-gradients step missed --ig-tolerance (or met NaN/inf); None without IG."""
    flags = [e.info["converged"] for e in result.explanations if "converged" in e.info]
    return all(flags) if flags else None
