"""`lmtrace show RUN`: a run's summary and its generated text coloured by token probability; with
--step, one generated step in detail (chosen token, alternatives, logit lens)."""

from __future__ import annotations

import math
import os
import sys
import warnings

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ..archive.runs import find_run, human_bytes, lens_state, runs_root
from ..archive.summary import run_summary
from ..exits.errors import ArchiveDamaged, LmtraceError, SpecError
from ..output.jsonout import json_line
from ..output.prob_colours import terminal_colour, terminal_legend

# what `stability` means (capture.sampling.stability_class), said under --step
STABILITY_LEGEND = (
    "of the model's top-1, whatever was chosen: locked = top-1 prob ≥ 0.9, stable = top-1 − top-2 "
    "margin ≥ 1 nat, fragile = margin ≥ 0.1 nat, tie = margin < 0.1 nat"
)


def _console() -> Console:
    """The terminal's width on a terminal; when piped, lines are not wrapped or cut at 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(soft_wrap=True)


def colour_wanted(no_color: bool = False) -> bool:
    """Colour only on a terminal, and not with --no-color or NO_COLOR set (https://no-color.org)."""
    if no_color or os.environ.get("NO_COLOR"):
        return False
    return Console().is_terminal


def prob_label(p: float) -> str:
    """A token's probability as `show` prints it without colour: 2 significant digits (0.93, 0.0012, 1)."""
    return f"{p:.2g}"


def show_run(
    ref: str,
    runs_dir: str | None,
    json_out: bool,
    *,
    no_color: bool = False,
    step: int | None = None,
    sequence: int | None = None,
    quiet: bool = False,
) -> None:
    """`lmtrace show`: the run's summary and texts; with `step`, that step of `sequence` (default 0) in detail.
    `quiet`: the generated texts alone, one per sequence (with `step`: the chosen token's text)."""
    # the reader (zarr, pandas: ~1 s to import) only here: `lmtrace ls` reads manifests alone
    from ..archive.reader import IncompleteRunWarning, Run

    path = find_run(ref, runs_root(runs_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = Run(path)
    if step is not None:
        detail = step_detail(run, 0 if sequence is None else sequence, step)
        if json_out:
            print(json_line(detail))
        elif quiet:
            sys.stdout.write(detail["token"]["text"] + "\n")
        else:
            _print_step(detail, _console())
        return
    summary = run_summary(path)
    seqs = run.sequences().to_pylist()  # (empty while no batch has finished; a damaged table is refused)
    if sequence is not None:
        _check_sequence(run, sequence)
        seqs = [s for s in seqs if s["sequence"] == sequence]
    if json_out:
        print(json_line({**summary, "sequences": seqs, "shards": run.shard_status, "manifest": run.manifest}))
        return
    if quiet:  # the texts exactly as decoded (special tokens removed), for scripts
        for s in seqs:
            sys.stdout.write(s["generated_text"] + "\n")
        return
    colour = colour_wanted(no_color)
    console = _console() if colour else Console(color_system=None, soft_wrap=True)
    _print_header(run, summary, console)
    tokens = run.tokens().to_pandas()  # (empty before the first committed block; a damaged table is refused)
    for s in seqs:
        console.rule(f"sequence {s['sequence']} ({s['generated_len']} tokens, stop: {s['stop_reason']})")
        console.print(Text(s["prompt"], style="dim"))
        t = tokens[(tokens.sequence == s["sequence"]) & (~tokens.is_prompt)].sort_values("step")
        if colour:
            text = Text()
            for tok, lp in zip(t.token_text, t.logprob):
                text.append(tok, style=terminal_colour(math.exp(lp)))
            console.print(text)
        else:  # the token texts exactly (rich would expand tabs and drop control characters)
            console.file.write(
                "".join(f"{tok}[{prob_label(math.exp(lp))}]" for tok, lp in zip(t.token_text, t.logprob)) + "\n"
            )
    if colour:
        legend = Text()
        legend.append("token colour = probability: ", style="dim")
        for label, colour in terminal_legend():
            legend.append(label + " ", style=colour)
        console.print(legend)


def _print_header(run, summary: dict, console: Console) -> None:
    m = run.manifest
    model = m.get("model") or {}
    console.print(
        f"[bold]run {escape(str(run.id))}[/bold]  status: {escape(str(summary['status']))}  "
        f"created: {escape(str(m.get('created')))}"
    )
    console.print(
        escape(
            f"model: {model.get('reference')} ({model.get('class')}, {m.get('dtype')} on {m.get('device')}, "
            f"attention kernel {(m.get('attention') or {}).get('kernel')})"
        )
    )
    gen = (m.get("spec_resolved") or {}).get("generation") or {}
    console.print(
        f"generation: max_new_tokens={gen.get('max_new_tokens')} temperature={gen.get('temperature')} "
        f"top_k={gen.get('top_k')} top_p={gen.get('top_p')} seed={gen.get('seed')}",
        markup=False,
    )
    console.print(
        f"captured layers: {len((m.get('shape') or {}).get('layers') or [])}  "
        f"arrays: {', '.join(m.get('arrays') or {}) or 'none'}",
        markup=False,
    )
    lens = m.get("lens")
    if lens:
        state = {
            "pending": f"deferred, not computed yet (`lmtrace lens {run.id}`)",
            "ready": "computed "
            + (
                "during generation"
                if lens.get("when", "inline") == "inline"
                else f"afterwards ({(lens.get('computed') or {}).get('at')})"
            ),
        }
        console.print(f"logit lens: {state[lens_state(m)]}", markup=False)
    if m.get("error"):
        console.print(Text(f"error: {m['error']}", style="red"))
    shards = run.shard_status
    if m.get("shards", 1) > 1 or len(shards) > 1:
        parts = [f"{k}: {v.get('status')}" for k, v in sorted(shards.items())]
        missing = m.get("shards", 1) - len(shards)
        console.print("shards: " + ", ".join(parts) + (f", {missing} not started" if missing > 0 else ""), markup=False)
    elif run.status != "complete":
        committed = run.committed_steps()
        console.print(f"committed steps per sequence: {committed}", markup=False)
    if m.get("parent"):
        console.print(f"parent: {m['parent']}", markup=False)
    console.print(
        f"size: {human_bytes(summary['size_bytes'])}  tokens: {summary['tokens']}  path: {run.path}", markup=False
    )


def _check_sequence(run, sequence: int) -> None:
    n = int(run.shape["n_sequences"])
    if not 0 <= sequence < n:
        raise SpecError(f"--sequence {sequence}: run {run.id} has sequences 0..{n - 1}")


def _step_row(run, sequence: int, step: int):
    """(the sequence's token rows by position, the row of its generated step `step`); a step the archive
    does not hold is refused in one line naming the steps it does."""
    try:
        t = run.tokens().to_pandas()
    except ArchiveDamaged:
        raise
    except LmtraceError:
        t = None
    if t is not None:
        t = t[t.sequence == sequence].sort_values("position")
    gen = t[~t.is_prompt] if t is not None else None
    rows = gen[gen.step == step] if gen is not None else []
    if len(rows) == 0:
        have = (
            f"steps 0..{len(gen) - 1} ({len(gen)} generated tokens archived)"
            if gen is not None and len(gen)
            else "no generated token archived yet"
        )
        raise SpecError(f"--step {step}: sequence {sequence} of run {run.id} has {have}")
    return t, rows.iloc[0]


def _token_facts(run, r, alternatives: list[dict]) -> dict:
    """The chosen token of row `r`: its id, text, probabilities, rank, margins, entropy and sampling facts."""
    rank = int(r["token_rank"])
    # the chosen token's logprob minus the best other token's: the model's margin when it chose its top-1,
    # else minus the top-1's logprob (the first alternative); unknown when no alternative was stored
    chosen_margin = (
        float(r.margin) if rank == 0 else float(r.logprob) - alternatives[0]["logprob"] if alternatives else None
    )
    return {
        "id": int(r.token_id),
        "text": r.token_text,
        "prob": float(r.prob),
        "logprob": float(r.logprob),
        "rank": rank,
        "margin": float(r.margin),
        "margin_chosen": chosen_margin,
        "entropy": float(r.entropy),
        "stability": r.stability,
        "sampling_prob": float(r.sampling_prob),
        "filter_changed": bool(r.filter_changed),
        "greedy_id": int(r.greedy_id),
        "greedy_text": run.text([int(r.greedy_id)])[0],
        "is_eos": bool(r.is_eos),
    }


def _step_lens(run, sequence: int, step: int) -> dict:
    """The logit lens at the step: its state, and per layer the top tokens once computed."""
    import numpy as np

    state = lens_state(run.manifest)
    lens: dict = {"state": state}
    if state == "pending":
        lens["note"] = f"not computed yet (deferred): run `lmtrace lens {run.id}`"
    elif state == "ready" and "lens_ids" in run.array_names():
        ids = np.asarray(run.array("lens_ids")[sequence, step])  # [layer, k_lens]
        probs = np.asarray(run.array("lens_probs")[sequence, step])
        texts = run.text(ids)
        lens["layers"] = [
            {
                "layer": int(layer),
                "top": [
                    {"id": int(i), "text": x, "prob": float(p)}
                    for i, x, p in zip(ids[li], texts[li], probs[li])
                    if i >= 0
                ],
            }
            for li, layer in enumerate(run.layers)
        ]
    return lens


def step_detail(run, sequence: int, step: int) -> dict:
    """One generated token in full: its statistics, alternatives and logit lens, ids as text (run.text)."""
    _check_sequence(run, sequence)
    t, r = _step_row(run, sequence, step)
    before = t[t.position < r.position].token_text.tolist()
    alt_ids = [int(i) for i in r.alt_ids]
    alternatives = [
        {"id": i, "text": x, "prob": math.exp(float(lp)), "logprob": float(lp)}
        for i, x, lp in zip(alt_ids, run.text(alt_ids), r.alt_logprobs)
    ]
    token = _token_facts(run, r, alternatives)
    lens = _step_lens(run, sequence, step)
    out = {
        "run_id": run.id,
        "sequence": sequence,
        "step": step,
        "position": int(r.position),
        "context": "".join(before),
        "token": token,
        "alternatives": alternatives,
        "lens": lens,
    }
    if run.manifest.get("features"):  # capture.features / `lmtrace features`: each SAE's active latents here
        out["features"] = step_features(run, sequence, step)
    return out


def step_features(run, sequence: int, step: int) -> list[dict]:
    """Per SAE of the run: the token's archived active latents, largest first (ties: the smaller latent
    first): every one of them, read by the token view's own `viewdata.features.token_features`."""
    from ..viewdata.features import token_features

    return [
        {
            "sae": f["sae"],
            "hook_name": f["hook_name"],
            **({"hook_name_out": f["hook_name_out"]} if "hook_name_out" in f else {}),
            "active": f["features"],
        }
        for f in token_features(run, sequence, step, top=None) or []
    ]


def _packed(head: str, cells: list[str], width: int) -> list[str]:
    """`head` and the cells two spaces apart, continued on lines indented under the first cell where
    the next cell would pass `width` (a cell is never split)."""
    lines, line = [], head + cells[0]
    for cell in cells[1:]:
        if len(line) + 2 + len(cell) > width:
            lines.append(line)
            line = " " * len(head) + cell
        else:
            line += "  " + cell
    return lines + [line]


def _print_step(d: dict, console: Console) -> None:
    def out(line: str) -> None:
        console.print(line, markup=False, highlight=False)

    tok = d["token"]
    context = d["context"]
    out(f"run {d['run_id']}  sequence {d['sequence']}  step {d['step']} (position {d['position']})")
    out("context: " + ("…" if len(context) > 200 else "") + repr(context[-200:]))
    out(
        f"chosen: {tok['text']!r} (id {tok['id']})  prob {tok['prob']:.4g}  logprob {tok['logprob']:.4g}  "
        f"rank {tok['rank'] + 1} (1 = the model's top-1)  entropy {tok['entropy']:.4g} nats"
    )
    chosen = "unknown (no alternative stored)" if tok["margin_chosen"] is None else f"{tok['margin_chosen']:.4g} nats"
    out(
        f"margins: the model's top-1 − top-2 {tok['margin']:.4g} nats; the chosen token − the best other token {chosen}"
    )
    out(f"stability: {tok['stability']} ({STABILITY_LEGEND})")
    if tok["rank"] != 0:
        out(
            f"model's top-1: {tok['greedy_text']!r} (id {tok['greedy_id']}); sampled with prob "
            f"{tok['sampling_prob']:.4g}" + ("; top-k/top-p changed the choice" if tok["filter_changed"] else "")
        )
    out("alternatives (top tokens at T=1):")
    width = max((len(repr(a["text"])) for a in d["alternatives"]), default=0)
    for n, a in enumerate(d["alternatives"], 1):
        out(f"  {n:2d}. {repr(a['text']).ljust(width)}  {a['prob']:.4g}  (id {a['id']})")
    if d.get("features"):
        from ..analysis.features.find import hook_label
    for f in d.get("features", []):
        cells = [f"{a['feature']} {a['activation']:.3g}" for a in f["active"]] or ["(none active)"]
        head = f"features of SAE {f['sae']} ({hook_label(f)}): "
        if len(head) > console.width // 2:  # the cells under a long head, not in a narrow column beside it
            out(head.rstrip())
            head = "  "
        for line in _packed(head, cells, console.width):
            out(line)
    lens = d["lens"]
    if lens["state"] == "none":
        out("logit lens: not captured in this run (capture.lens)")
    elif lens["state"] == "pending":
        out(f"logit lens: {lens['note']}")
    else:
        out("logit lens (top tokens of each captured layer's residual, with probabilities):")
        for row in lens.get("layers", []):
            cells = [f"{c['text']!r} {c['prob']:.2g}" for c in row["top"]] or ["(not archived)"]
            for line in _packed(f"  layer {row['layer']:3d}: ", cells, console.width):
                out(line)
