"""Terminal views of runs: `lmtrace ls` and `lmtrace show` (rich tables and coloured text)."""

from __future__ import annotations

import json
import math
import warnings

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .archive import layout
from .archive.reader import IncompleteRunWarning, Run
from .runs import dir_size, find_run, list_runs, read_manifest, runs_root


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}P"


def run_summary(path) -> dict:
    m = read_manifest(path)
    return {
        "run_id": m.get("run_id", path.name), "status": m.get("status"), "kind": m.get("kind"),
        "model": m.get("model", {}).get("reference"), "prompts": m.get("n_prompts"),
        "tokens": m.get("n_generated_tokens"), "size_bytes": dir_size(path), "created": m.get("created"),
        "parent": m.get("parent"), "path": str(path),
    }


def list_table(runs_dir: str | None, json_out: bool) -> None:
    root = runs_root(runs_dir)
    rows = [run_summary(p) for p in list_runs(root)]
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    console = Console()
    if not rows:
        console.print(f"no runs in {root}")
        return
    table = Table(title=f"runs in {root}")
    for col in ("run id", "status", "model", "prompts", "tokens", "size", "created"):
        table.add_column(col)
    colours = {"complete": "green", "running": "yellow", "interrupted": "magenta", "failed": "red"}
    for r in rows:
        table.add_row(r["run_id"], Text(str(r["status"]), style=colours.get(r["status"], "")), str(r["model"]),
                      str(r["prompts"]), str(r["tokens"] if r["tokens"] is not None else "-"),
                      _human(r["size_bytes"]), str(r["created"]))
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


def show_run(ref: str, runs_dir: str | None, json_out: bool) -> None:
    path = find_run(ref, runs_root(runs_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = Run(path)
    summary = run_summary(path)
    try:
        seqs = run.sequences().to_pylist()
    except Exception:  # an unfinished run may have no finished batch yet
        seqs = []
    if json_out:
        print(json.dumps({**summary, "sequences": seqs, "manifest": run.manifest}, indent=2, default=str))
        return
    console = Console()
    m = run.manifest
    console.print(f"[bold]run {run.id}[/bold]  status: {run.status}  created: {m.get('created')}")
    console.print(f"model: {m['model']['reference']} ({m['model']['class']}, {m.get('dtype')} on {m.get('device')}, "
                  f"attention kernel {m.get('attention', {}).get('kernel')})")
    gen = m["spec_resolved"]["generation"]
    console.print(f"generation: max_new_tokens={gen['max_new_tokens']} temperature={gen['temperature']} "
                  f"top_k={gen['top_k']} top_p={gen['top_p']} seed={gen['seed']}")
    console.print(f"captured layers: {len(m['shape']['layers'])}  arrays: {', '.join(m.get('arrays', {})) or 'none'}")
    if m.get("error"):
        console.print(f"[red]error: {m['error']}[/red]")
    if m.get("parent"):
        console.print(f"parent: {m['parent']}")
    console.print(f"size: {_human(summary['size_bytes'])}  tokens: {summary['tokens']}  path: {path}")
    try:
        tokens = run.tokens().to_pandas()
    except Exception:
        tokens = None
    for s in seqs:
        console.rule(f"sequence {s['sequence']} ({s['generated_len']} tokens, stop: {s['stop_reason']})")
        console.print(Text(s["prompt"], style="dim"))
        if tokens is None:
            continue
        t = tokens[(tokens.sequence == s["sequence"]) & (~tokens.is_prompt)].sort_values("step")
        text = Text()
        for tok, lp in zip(t.token_text, t.logprob):
            text.append(tok, style=_prob_style(math.exp(lp)))
        console.print(text)
    console.print(Text("token colour = probability: ", style="dim") + Text(">=0.8 ", style="green")
                  + Text(">=0.4 ", style="yellow") + Text(">=0.1 ", style="dark_orange") + Text("<0.1", style="red"))
