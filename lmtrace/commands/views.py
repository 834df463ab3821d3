"""Terminal views of runs: `lmtrace ls` and `lmtrace show` (rich tables and coloured text)."""

from __future__ import annotations

import json
import math
import os
import warnings

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import LmtraceError, RunNotFoundError, SpecError
from ..jsonout import json_line
from ..archive.runs import dir_size, find_run, human_bytes, lens_state, list_runs, read_manifest, runs_root


def _console(table: bool = False) -> Console:
    """The terminal's width on a terminal; when piped, lines are not wrapped or cut at 80 columns."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=400) if table else Console(soft_wrap=True)


def _shards_done(path, m: dict) -> str | None:
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
    from ..archive.integrity import quick_problem
    from ..archive.liveness import shown_status

    m = read_manifest(path)
    shards = _shards_done(path, m)
    status = shown_status(path, m)  # `killed`: says running, but no live process writes it
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


def verify_run(ref: str, runs_dir: str | None, json_out: bool) -> int:
    """`lmtrace verify RUN`: every committed file against the checksums recorded at completion.
    Returns the exit code: 0 intact, 2 damaged (or nothing to verify: the run is not complete)."""
    from ..archive.integrity import verify

    path = find_run(ref, runs_root(runs_dir))
    m = read_manifest(path)
    run_id = m.get("run_id", path.name)
    if m.get("status") != "complete":
        result = {"run_id": run_id, "status": m.get("status"), "ok": None,
                  "message": f"run {run_id} is {m.get('status')}: checksums are recorded when a run completes"}
        code = 0
    else:
        problems, n, recorded = verify(path, m)
        result = {"run_id": run_id, "status": "damaged" if problems else "complete", "ok": not problems,
                  "files_checked": n, "checksums_recorded": recorded,
                  "problems": [{"path": p.path, "kind": p.kind} for p in problems]}
        if problems:
            shown = "; ".join(str(p) for p in problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
            result["message"] = f"run {run_id} is damaged: {shown}"
        elif recorded:
            result["message"] = f"run {run_id}: {n} files match their checksums"
        else:
            result["message"] = (f"run {run_id}: no checksums recorded (completed before lmtrace recorded them); "
                                 f"its tables are present")
        code = 2 if problems else 0
    if json_out:
        print(json_line(result))
    elif code:
        import sys

        print(f"error: {result['message']}", file=sys.stderr)
    else:
        print(result["message"])
    return code


def _summary_or_damaged(path) -> dict:
    try:
        return run_summary(path)
    except RunNotFoundError as err:  # one damaged manifest must not hide every other run
        return {"run_id": path.name, "status": "damaged", "kind": None, "model": None, "prompts": None,
                "tokens": None, "size_bytes": dir_size(path), "created": None, "parent": None, "parent_id": None,
                "edits": None, "lens": None, "path": str(path), "error": str(err)}


KINDS = ("generate", "intervene")


def list_table(runs_dir: str | None, json_out: bool, kind: str | None = None) -> None:
    root = runs_root(runs_dir)
    if kind is not None and kind not in KINDS:
        raise SpecError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    rows = [_summary_or_damaged(p) for p in list_runs(root)]
    if kind is not None:
        rows = [r for r in rows if r["kind"] == kind]
    if json_out:
        print(json_line(rows))
        return
    console = _console(table=True)
    if not rows:
        console.print(f"no runs in {root}", markup=False, highlight=False)
        return
    table = Table(title=escape(f"runs in {root}"))
    table.add_column("run id", no_wrap=True, min_width=max(len(r["run_id"]) for r in rows))
    for col in ("kind", "status", "model", "prompts", "tokens", "lens", "parent", "edits", "size", "created"):
        table.add_column(col, overflow="fold")
    colours = {"complete": "green", "running": "yellow", "interrupted": "magenta", "failed": "red", "damaged": "red"}
    dash = lambda v: "-" if v is None else str(v)  # noqa: E731
    for r in rows:
        table.add_row(Text(r["run_id"]), dash(r["kind"]), Text(str(r["status"]), style=colours.get(r["status"], "")),
                      Text(str(r["model"])), str(r["prompts"]), dash(r["tokens"]), dash(r["lens"]),
                      Text(dash(r["parent_id"])), Text(dash(r["edits"])), human_bytes(r["size_bytes"]),
                      Text(str(r["created"])))
    console.print(table)


def _prob_style(p: float) -> str:
    """Green for confident tokens through yellow to red for unlikely ones."""
    if p >= 0.8:
        return "green"
    if p >= 0.4:
        return "yellow"
    if p >= 0.1:
        return "dark_orange"
    return "red"


def colour_wanted(no_color: bool = False) -> bool:
    """Colour only on a terminal, and not with --no-color or NO_COLOR set (https://no-color.org)."""
    if no_color or os.environ.get("NO_COLOR"):
        return False
    return Console().is_terminal


def prob_label(p: float) -> str:
    """A token's probability as `show` prints it without colour: 2 significant digits (0.93, 0.0012, 1)."""
    return f"{p:.2g}"


def show_run(ref: str, runs_dir: str | None, json_out: bool, *, no_color: bool = False,
             step: int | None = None, sequence: int | None = None) -> None:
    """`lmtrace show`: the run's summary and texts; with `step`, that step of `sequence` (default 0) in detail."""
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
                text.append(tok, style=_prob_style(math.exp(lp)))
            console.print(text)
        else:  # the token texts exactly (rich would expand tabs and drop control characters)
            console.file.write("".join(f"{tok}[{prob_label(math.exp(lp))}]" for tok, lp in zip(t.token_text, t.logprob))
                               + "\n")
    if colour:
        console.print(Text("token colour = probability: ", style="dim") + Text(">=0.8 ", style="green")
                      + Text(">=0.4 ", style="yellow") + Text(">=0.1 ", style="dark_orange") + Text("<0.1", style="red"))


def _print_header(run, summary: dict, console: Console) -> None:

    m = run.manifest
    model = m.get("model") or {}
    console.print(f"[bold]run {escape(str(run.id))}[/bold]  status: {escape(str(summary['status']))}  "
                  f"created: {escape(str(m.get('created')))}")
    console.print(escape(f"model: {model.get('reference')} ({model.get('class')}, {m.get('dtype')} on {m.get('device')}, "
                         f"attention kernel {(m.get('attention') or {}).get('kernel')})"))
    gen = (m.get("spec_resolved") or {}).get("generation") or {}
    console.print(f"generation: max_new_tokens={gen.get('max_new_tokens')} temperature={gen.get('temperature')} "
                  f"top_k={gen.get('top_k')} top_p={gen.get('top_p')} seed={gen.get('seed')}", markup=False)
    console.print(f"captured layers: {len((m.get('shape') or {}).get('layers') or [])}  "
                  f"arrays: {', '.join(m.get('arrays') or {}) or 'none'}", markup=False)
    lens = m.get("lens")
    if lens:
        state = {"pending": f"deferred, not computed yet (`lmtrace lens {run.id}`)",
                 "ready": "computed " + ("during generation" if lens.get("when", "inline") == "inline"
                                         else f"afterwards ({(lens.get('computed') or {}).get('at')})")}
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
    console.print(f"size: {human_bytes(summary['size_bytes'])}  tokens: {summary['tokens']}  path: {run.path}", markup=False)


def _check_sequence(run, sequence: int) -> None:
    n = int(run.shape["n_sequences"])
    if not 0 <= sequence < n:
        raise SpecError(f"--sequence {sequence}: run {run.id} has sequences 0..{n - 1}")


def step_detail(run, sequence: int, step: int) -> dict:
    """One generated token in full: its statistics, alternatives and logit lens, ids as text (run.text)."""
    import numpy as np


    _check_sequence(run, sequence)
    try:
        t = run.tokens().to_pandas()
    except LmtraceError:
        t = None
    if t is not None:
        t = t[t.sequence == sequence].sort_values("position")
    gen = t[~t.is_prompt] if t is not None else None
    rows = gen[gen.step == step] if gen is not None else []
    if len(rows) == 0:
        have = (f"steps 0..{len(gen) - 1} ({len(gen)} generated tokens archived)" if gen is not None and len(gen)
                else "no generated token archived yet")
        raise SpecError(f"--step {step}: sequence {sequence} of run {run.id} has {have}")
    r = rows.iloc[0]
    before = t[t.position < r.position].token_text.tolist()
    alt_ids = [int(i) for i in r.alt_ids]
    alternatives = [{"id": i, "text": x, "prob": math.exp(float(lp)), "logprob": float(lp)}
                    for i, x, lp in zip(alt_ids, run.text(alt_ids), r.alt_logprobs)]
    token = {
        "id": int(r.token_id), "text": r.token_text, "prob": float(r.prob), "logprob": float(r.logprob),
        "rank": int(r["rank"]), "margin": float(r.margin), "entropy": float(r.entropy), "stability": r.stability,
        "sampling_prob": float(r.sampling_prob), "filter_changed": bool(r.filter_changed),
        "greedy_id": int(r.greedy_id), "greedy_text": run.text([int(r.greedy_id)])[0], "is_eos": bool(r.is_eos),
    }
    state = lens_state(run.manifest)
    lens: dict = {"state": state}
    if state == "pending":
        lens["note"] = f"not computed yet (deferred): run `lmtrace lens {run.id}`"
    elif state == "ready" and "lens_ids" in run.array_names():
        ids = np.asarray(run.array("lens_ids")[sequence, step])  # [layer, k_lens]
        probs = np.asarray(run.array("lens_probs")[sequence, step])
        texts = run.text(ids)
        lens["layers"] = [
            {"layer": int(layer), "top": [{"id": int(i), "text": x, "prob": float(p)}
                                          for i, x, p in zip(ids[li], texts[li], probs[li]) if i >= 0]}
            for li, layer in enumerate(run.layers)]
    return {"run_id": run.id, "sequence": sequence, "step": step, "position": int(r.position),
            "context": "".join(before), "token": token, "alternatives": alternatives, "lens": lens}


def _print_step(d: dict, console: Console) -> None:
    def out(line: str) -> None:
        console.print(line, markup=False, highlight=False)

    tok = d["token"]
    context = d["context"]
    out(f"run {d['run_id']}  sequence {d['sequence']}  step {d['step']} (position {d['position']})")
    out("context: " + ("…" if len(context) > 200 else "") + repr(context[-200:]))
    out(f"chosen: {tok['text']!r} (id {tok['id']})  prob {tok['prob']:.4g}  logprob {tok['logprob']:.4g}  "
        f"rank {tok['rank']}  margin {tok['margin']:.4g}  entropy {tok['entropy']:.4g} nats  {tok['stability']}")
    if tok["rank"] != 0:
        out(f"model's top-1: {tok['greedy_text']!r} (id {tok['greedy_id']}); sampled with prob "
            f"{tok['sampling_prob']:.4g}" + ("; top-k/top-p changed the choice" if tok["filter_changed"] else ""))
    out("alternatives (top tokens at T=1):")
    width = max((len(repr(a["text"])) for a in d["alternatives"]), default=0)
    for n, a in enumerate(d["alternatives"], 1):
        out(f"  {n:2d}. {repr(a['text']).ljust(width)}  {a['prob']:.4g}  (id {a['id']})")
    lens = d["lens"]
    if lens["state"] == "none":
        out("logit lens: not captured in this run (capture.lens)")
    elif lens["state"] == "pending":
        out(f"logit lens: {lens['note']}")
    else:
        out("logit lens (top tokens of each captured layer's residual, with probabilities):")
        for row in lens.get("layers", []):
            cells = "  ".join(f"{c['text']!r} {c['prob']:.2g}" for c in row["top"]) or "(not archived)"
            out(f"  layer {row['layer']:3d}: {cells}")


# ---- `lmtrace compare` -------------------------------------------------------------------------
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
    return (f"{label} {info['run_id']} ({info['status']}): {info['model']}, T={g['temperature']} top_k={g['top_k']} "
            f"top_p={g['top_p']} seed={g['seed']} max_new_tokens={g['max_new_tokens']}"
            + (f", parent {parent}" if parent else ""))


def _cmp_pairing_line(cmp) -> str:
    p = cmp.pairing
    shown = ", ".join(f"A{a}↔B{b}" for a, b in p["pairs"][:8]) + (" …" if len(p["pairs"]) > 8 else "")
    line = f"pairing by {p['method']}: {len(p['pairs'])} pair(s) ({shown or 'none'})"
    if p["unpaired_a"] or p["unpaired_b"]:
        line += (f"; unpaired: A {p['unpaired_a'] or '–'}, B {p['unpaired_b'] or '–'}")
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
            cells.append(f"{t['text']!r} p={_cmp_prob(t[f'logprob_under_{side}'])}, "
                         f"under {other.upper()}: {_cmp_prob(t[f'logprob_under_{other}'])}")
    return f"step {d['step']}", cells[0], cells[1]


def _cmp_chosen(r: dict) -> str:
    return repr(r["text_a"]) if r["token_a"] == r["token_b"] else f"{r['text_a']!r} / {r['text_b']!r}"


def _cmp_top_steps(cmp, top: int) -> list[dict]:
    """Paired steps with the largest JS (exact when --exact computed it, else over the stored top-k; non-zero)."""
    def js(r):
        return r.get("exact_js") if r.get("exact_js") is not None else r["js"]
    rows = [r for r in cmp.per_step.to_pylist() if js(r) is not None and js(r) > 0]
    return sorted(rows, key=lambda r: -js(r))[:top]


def render_comparison(cmp, console: Console | None = None, top: int = 5) -> None:
    """The terminal summary of a `compare.Comparison`: verdict, pairs, texts, the layers and heads that changed most."""
    if console is None:
        console = Console() if Console().is_terminal else Console(width=160, soft_wrap=True)
    console.print(Text(_cmp_run_line("A", cmp.a)))
    console.print(Text(_cmp_run_line("B", cmp.b)))
    if cmp.spec_differences:
        diffs = "; ".join(f"{d['key']}: {d['a']} → {d['b']}" for d in cmp.spec_differences[:8])
        console.print(Text(f"differences: {diffs}" + (" …" if len(cmp.spec_differences) > 8 else "")))
    else:
        console.print(Text("differences: none in the resolved specs (model weights equal)", style="dim"))
    tok = cmp.compatibility["tokenizer"]
    console.print(Text(f"tokenizer: {tok['class_a']}, {tok['vocab_size']} tokens, "
                       f"{tok['token_ids_cross_checked']} token texts cross-checked", style="dim"))
    console.print(Text(_cmp_pairing_line(cmp)))
    console.print(Text(cmp.verdict, style="bold green" if cmp.identical else "bold yellow"))
    for note in cmp.notes:
        console.print(Text(f"note: {note}", style="dim"))
    if not cmp.pairs:
        return

    table = Table(title="sequence pairs (paired figures: steps with identical contexts only)", title_justify="left")
    for col in ("pair", "A↔B", "first divergence", "A's token", "B's token", "paired steps", "mean KL(A‖B)",
                "max JS", "top-1 agree"):
        table.add_column(col, overflow="fold")
    for p in cmp.pairs[: max(top, 10)]:
        f = p["paired_figures"] or {}
        where, ta, tb = _cmp_divergence_cells(p)
        table.add_row(str(p["pair"]), f"{p['seq_a']}↔{p['seq_b']}", where, Text(ta), Text(tb), str(p["paired_steps"]),
                      _cmp_num(f.get("mean_kl_ab")), _cmp_num(f.get("max_js")),
                      "–" if f.get("top1_agreement") is None else f"{f['top1_agreement']:.0%}")
    console.print(table)
    if len(cmp.pairs) > max(top, 10):
        console.print(Text(f"… {len(cmp.pairs) - max(top, 10)} more pair(s) in --json / --out", style="dim"))

    shown = [p for p in cmp.pairs if p["first_divergence"] is not None or not p["same_prompt_ids"]][:min(top, 3)]
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
            console.print(Text(f"  step-0 logit difference, A's {ld['text_a']!r} − B's {ld['text_b']!r}: under A "
                               f"{_cmp_num(ld['under_a'])}, under B {_cmp_num(ld['under_b'])} nats "
                               f"(– = a token outside that run's stored top-k)", style="dim"))

    steps = _cmp_top_steps(cmp, top)
    exact = any(r.get("exact_js") is not None for r in steps)
    if steps:
        t = Table(title="steps whose next-token distribution changed most (paired steps)", title_justify="left")
        cols = ["pair", "step", "chosen (A / B)", "JS (top-k, ≥)", "KL(A‖B) (top-k, ≥)"]
        cols += ["exact JS", "exact KL(A‖B)", "max |Δ logit|"] if exact else []
        for col in cols + ["Δ entropy", "Δ margin", "top-1 agree"]:
            t.add_column(col, overflow="fold")
        for r in steps:
            extra = [_cmp_num(r.get("exact_js")), _cmp_num(r.get("exact_kl_ab")),
                     _cmp_num(r.get("exact_max_abs_logit_diff"))] if exact else []
            t.add_row(str(r["pair"]), str(r["step"]), Text(_cmp_chosen(r)), _cmp_num(r["js"]), _cmp_num(r["kl_ab"]),
                      *extra, _cmp_num(r["entropy_delta"]), _cmp_num(r["margin_delta"]),
                      "yes" if r["top1_agree"] else "no")
        console.print(t)

    layers = [r for r in cmp.layers if r["changed"]][:top]
    if layers:
        t = Table(title=f"layers that changed most (of {len(cmp.layers)}; paired steps; changes start at layer "
                        f"{cmp.first_changed_layer})", title_justify="left")
        for col in ("layer", "Δ layer-output norm (rel)", "Δ resid norm (rel)", "attn JS mean", "lens winner changes",
                    "Δ margin contrib"):
            t.add_column(col)
        for r in layers:
            t.add_row(str(r["layer"]), _cmp_num(r["delta_norm_rel_change"]), _cmp_num(r["resid_norm_rel_change"]),
                      _cmp_num(r["attn_js_mean"]), _cmp_num(r["lens_changes"]), _cmp_num(r["margin_contrib_abs_delta"]))
        console.print(t)
    elif cmp.layers:
        console.print(Text(f"layers: no per-layer figure differs at any paired step ({len(cmp.layers)} layers)",
                           style="green"))
    heads = [r for r in cmp.heads if r["attn_js_mean"] > 0][:top]
    if heads:
        t = Table(title=f"heads that changed most (of {len(cmp.heads)})", title_justify="left",
                  caption="attention-row JS, nats", caption_justify="left")
        for col in ("layer.head", "mean JS", "max JS"):
            t.add_column(col)
        for r in heads:
            t.add_row(f"{r['layer']}.{r['head']}", _cmp_num(r["attn_js_mean"]), _cmp_num(r["attn_js_max"]))
        console.print(t)
    after = [p["after_divergence"] for p in cmp.pairs if p["after_divergence"] and
             (p["after_divergence"]["steps_a"] or p["after_divergence"]["steps_b"])]
    if after:
        def avg(key):
            vals = [a[key] for a in after if a[key] is not None]
            return sum(vals) / len(vals) if vals else None

        console.print(Text(
            f"after divergence (per side, NOT paired: each side saw its own text): mean logprob A {_cmp_num(avg('mean_logprob_a'))} "
            f"/ B {_cmp_num(avg('mean_logprob_b'))}, mean entropy A {_cmp_num(avg('mean_entropy_a'))} "
            f"/ B {_cmp_num(avg('mean_entropy_b'))} nats", style="dim"))
    console.print(Text("KL/JS: nats, over the tokens stored on both sides + one tail bucket (a lower bound of the "
                       "full-vocabulary value" + ("; exact columns: full vocabulary, from the models" if exact else
                                                  "; --exact computes it from the models") +
                       "); deltas are B − A; see docs/compare.md", style="dim"))


def comparison_markdown(cmp, top: int = 10) -> str:
    """A small markdown report of a `compare.Comparison` (written as report.md by --out)."""
    def cell(x) -> str:
        return str(x).replace("|", "\\|").replace("\n", "⏎")

    lines = ["# lmtrace compare", "", f"- {cell(_cmp_run_line('A', cmp.a))}", f"- {cell(_cmp_run_line('B', cmp.b))}"]
    if cmp.spec_differences:
        lines.append("- differences: " + "; ".join(f"`{d['key']}`: {cell(d['a'])} → {cell(d['b'])}"
                                                   for d in cmp.spec_differences))
    lines += [f"- {cell(_cmp_pairing_line(cmp))}", "", f"**{cell(cmp.verdict)}**", ""]
    lines += [f"> note: {cell(n)}" for n in cmp.notes]
    lines += ["", "## Sequence pairs", "",
              "| pair | A↔B | first divergence | A's token | B's token | paired steps | mean KL(A‖B) | max JS | top-1 agree |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in cmp.pairs:
        f = p["paired_figures"] or {}
        where, ta, tb = _cmp_divergence_cells(p)
        agree = "–" if f.get("top1_agreement") is None else f"{f['top1_agreement']:.0%}"
        lines.append(f"| {p['pair']} | {p['seq_a']}↔{p['seq_b']} | {cell(where)} | {cell(ta)} | {cell(tb)} | "
                     f"{p['paired_steps']} | {_cmp_num(f.get('mean_kl_ab'))} | {_cmp_num(f.get('max_js'))} | {agree} |")
    for p in cmp.pairs:
        if p["first_divergence"] is None and p["same_prompt_ids"]:
            continue
        d = p["first_divergence"]
        lines += ["", f"### Pair {p['pair']}" + (f" — diverges at step {d['step']}" if d else ""), ""]
        if d and d.get("explanation"):
            lines += [cell(d["explanation"]), ""]
        lines += ["| | text |", "|---|---|", f"| shared | {cell(p['text']['common'])} |",
                  f"| A | {cell(p['text']['a'])} |", f"| B | {cell(p['text']['b'])} |"]
    steps = _cmp_top_steps(cmp, top)
    if steps:
        lines += ["", "## Steps whose next-token distribution changed most", "",
                  "| pair | step | chosen (A / B) | JS | KL(A‖B) | Δ entropy | Δ margin | top-1 agree |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in steps:
            lines.append(f"| {r['pair']} | {r['step']} | {cell(_cmp_chosen(r))} | {_cmp_num(r['js'])} | {_cmp_num(r['kl_ab'])} | "
                         f"{_cmp_num(r['entropy_delta'])} | {_cmp_num(r['margin_delta'])} | {'yes' if r['top1_agree'] else 'no'} |")
    if cmp.layers:
        start = "no layer changed" if cmp.first_changed_layer is None else f"changes start at layer {cmp.first_changed_layer}"
        lines += ["", f"## Layers (paired steps; {start})", "",
                  "| layer | Δ layer-output norm (rel) | Δ resid norm (rel) | attn JS mean | lens winner changes | Δ margin contrib |",
                  "|---|---|---|---|---|---|"]
        for r in cmp.layers[:top]:
            lines.append(f"| {r['layer']} | {_cmp_num(r['delta_norm_rel_change'])} | {_cmp_num(r['resid_norm_rel_change'])} | "
                         f"{_cmp_num(r['attn_js_mean'])} | {_cmp_num(r['lens_changes'])} | "
                         f"{_cmp_num(r['margin_contrib_abs_delta'])} |")
    heads = [r for r in cmp.heads if r["attn_js_mean"] > 0]
    if cmp.heads and not heads:
        lines += ["", "## Heads", "", f"No attention row differs at any paired step ({len(cmp.heads)} heads)."]
    if heads:
        lines += ["", "## Heads (attention-row JS, nats)", "", "| layer.head | mean JS | max JS |", "|---|---|---|"]
        for r in heads[:top]:
            lines.append(f"| {r['layer']}.{r['head']} | {_cmp_num(r['attn_js_mean'])} | {_cmp_num(r['attn_js_max'])} |")
    lines += ["", "KL/JS are in nats over the tokens stored on both sides plus one tail bucket (lower bounds of the "
              "full-vocabulary values); deltas are B − A; figures after a divergence are per side and not paired. "
              "Tables: per_step.parquet, per_layer.parquet, per_head.parquet, pairs.parquet. Definitions: docs/compare.md.", ""]
    return "\n".join(lines)


def compare_view(run_a: str, run_b: str, *, runs_dir: str | None = None, allow_incomplete: bool = False,
                 pair: str = "auto", json_out: bool = False, out_dir=None, top: int = 5, html_path=None,
                 exact: bool = False, exact_steps: str | None = None, device: str | None = None) -> None:
    """`lmtrace compare`: compute, optionally write the tables and report, then print the summary or JSON."""
    from pathlib import Path

    from .compare import compare_runs

    import sys

    def note(text: str) -> None:
        if not json_out:
            print(text, file=sys.stderr)

    if exact_steps is not None and not exact:
        from ..errors import SpecError

        raise SpecError("--exact-steps needs --exact")
    cmp = compare_runs(run_a, run_b, runs_dir=runs_dir, allow_incomplete=allow_incomplete, pair=pair, exact=exact,
                       exact_steps=exact_steps, device=device, note=note)
    if out_dir is not None:
        cmp.write_tables(out_dir)
        (Path(out_dir) / "report.md").write_text(comparison_markdown(cmp, top=max(top, 10)))
    if html_path is not None:
        from ..report import report_compare

        report_compare(run_a, run_b, out=html_path, comparison=cmp)
    if json_out:
        print(json_line(cmp.summary()))
        return
    console = Console() if Console().is_terminal else Console(width=160, soft_wrap=True)
    render_comparison(cmp, console, top)
    if out_dir is not None:
        console.print(Text(f"wrote per_step/per_layer/per_head/pairs.parquet, summary.json and report.md to {out_dir}"))
