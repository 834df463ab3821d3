"""`lmtrace features RUN --sae NAME|DIR --feature F` and `--by COLUMN`: finding features in a run's
archived feature arrays (computed by `generate` with `capture.features`, or `lmtrace features RUN
--sae DIR`). The numbers come from `analysis/features/find.py`; this module picks the SAE, reads the
run and prints (or `--json`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from ..archive.reader import IncompleteRunWarning, Run, open_run
from ..exits.errors import SpecError
from ..output.jsonout import json_line
from ..output.terminal import fitted, terminal_width


def resolve_sae(run: Run, sae: str) -> dict:
    """The run's manifest entry for `sae`: one of its SAE names, or a directory whose weights (sha256)
    or path is one the run names."""
    entries = run.manifest.get("features") or []
    if not entries:
        raise SpecError(
            f"run {run.id} has no feature activations: compute them with `lmtrace features {run.id} "
            f"--sae DIR` (or generate with capture.features / --sae DIR)"
        )
    for f in entries:
        if f["name"] == sae:
            return f
    path = Path(sae).expanduser()
    if path.is_dir():
        from ..digest import file_sha256
        from ..features.format import WEIGHTS

        sha = file_sha256(path / WEIGHTS) if (path / WEIGHTS).is_file() else None
        for f in entries:
            if f["sha256"] == sha or f["path"] == str(path.resolve()):
                return f
        raise SpecError(
            f"--sae {sae}: run {run.id} has no features of this SAE; compute them with "
            f"`lmtrace features {run.id} --sae {sae}`"
        )
    raise SpecError(
        f"--sae {sae!r}: not an SAE of run {run.id} (its SAEs: {', '.join(f['name'] for f in entries)}) nor a directory"
    )


def _token_texts(run: Run, sequences: list[int]) -> dict[int, list[str]]:
    """The token texts of `sequences` (only their rows of tokens.parquet are read), in position order."""
    if not sequences:
        return {}
    t = run.table("tokens", columns=["sequence", "position", "token_text"], sequences=sorted(set(sequences)))
    seq = t.column("sequence").to_numpy()
    order = np.lexsort((t.column("position").to_numpy(), seq))
    texts = t.column("token_text").to_pylist()
    out: dict[int, list[str]] = {}
    for i in order.tolist():
        out.setdefault(int(seq[i]), []).append(texts[i])
    return out


def _check_prompt(run: Run, entry: dict, prompt: bool) -> None:
    if prompt and not entry.get("prompt"):
        raise SpecError(
            f"--prompt: run {run.id} has no prompt-position features of SAE {entry['name']}; compute them "
            f"with `lmtrace features {run.id} --sae {entry['path']} --prompt`"
        )


def feature_report(
    run: Run,
    entry: dict,
    feature: int,
    *,
    top: int,
    window: int,
    n_tokens: int,
    device: str | None,
    prompt: bool = False,
) -> dict:
    """`prompt`: over the prompt positions (the run's `prompt_feat_*` arrays) instead of the generated
    tokens; an example is then the token at which the activation was read, its step None."""
    from ..analysis.features.find import context, occurrences

    if not 0 <= feature < int(entry["d_sae"]):
        raise SpecError(f"--feature {feature}: SAE {entry['name']} has latents 0..{int(entry['d_sae']) - 1}")
    _check_prompt(run, entry, prompt)
    occ = occurrences(run, entry["name"], feature, prompt=prompt)
    found = occ.top(top)
    texts = _token_texts(run, [seq for seq, _, _ in found])
    prompt_len = run.prompt_len()
    rows = []
    for seq, step, value in found:
        position = step if prompt else int(prompt_len[seq]) + step
        rows.append(
            {
                "sequence": seq,
                "step": None if prompt else step,
                "position": position,
                "activation": value,
                "token": texts[seq][position] if position < len(texts[seq]) else "",
                "context": context(texts[seq], position, window),
            }
        )
    return {
        "run_id": run.id,
        "sae": entry["name"],
        "hook_name": entry["hook_name"],
        **({"hook_name_out": entry["hook_name_out"]} if entry.get("hook_name_out") else {}),
        "feature": feature,
        "positions": "prompt" if prompt else "generated",
        "tokens": occ.n_tokens,
        "active_tokens": occ.n_active,
        "density": occ.density,
        "examples": rows,
        "logit_effects": _logit_effects(run, entry, feature, n_tokens, device),
    }


def _logit_effects(run: Run, entry: dict, feature: int, n: int, device: str | None) -> dict:
    """The decoder row through the final norm and unembedding of the run's model (loaded for it); a
    transcoder's decoder row writes its output site (the MLP's output, added to the residual stream)."""
    writes = entry.get("site_out") or entry["site"]  # a transcoder's decoder writes its output site
    if writes not in ("resid_pre", "resid_post", "attn_out", "mlp_out"):
        return {
            "promoted": None,
            "suppressed": None,
            "note": f"{writes} is not written into the residual stream as it is: no logit effects",
        }
    from ..analysis.features.find import logit_effects_np, store_logit_effects
    from ..analysis.features.unembedding import WEIGHTS, decoder_row, final_unembedding
    from ..digest import file_sha256

    weights = Path(entry["path"]) / WEIGHTS
    if not weights.is_file():
        raise SpecError(
            f"SAE {entry['path']}: {WEIGHTS} is missing; the logit effects read the SAE's decoder: restore "
            f"the directory the run's features were computed with"
        )
    if file_sha256(weights) != entry["sha256"]:
        raise SpecError(
            f"SAE {entry['path']}: its weights changed since the run's features were computed "
            f"(sha256 differs from manifest `features`); restore them, or compute the features again"
        )
    final = final_unembedding(run.manifest, run.id, device, "the logit effects of a feature")
    up, down = logit_effects_np(final, decoder_row(Path(entry["path"]), feature), n)

    def text(pairs):
        return [{"id": i, "text": t, "effect": e} for (i, e), t in zip(pairs, run.text([i for i, _ in pairs]))]

    effects = {
        "promoted": text(up),
        "suppressed": text(down),
        "method": "W_dec[F], centred for a LayerNorm, times the final norm's gain, through the unembedding",
    }
    store_logit_effects(run.path, entry, feature, effects)  # for serve and report, which load no model
    return effects


def by_report(run: Run, entry: dict, column: str, top: int, prompt: bool = False) -> dict:
    from ..analysis.features.find import FeatureArrays, by_groups
    from ..archive.groups import plain_value, sequence_groups

    groups = sequence_groups(run, column)
    _check_prompt(run, entry, prompt)
    arrays = FeatureArrays.read(run, entry["name"], prompt=prompt)
    values, rows = by_groups(arrays, int(entry["d_sae"]), groups.of, top)
    return {
        "run_id": run.id,
        "sae": entry["name"],
        "group_column": column,
        "groups": [plain_value(v) for v in values],
        "interval": "95 % percentile bootstrap over the group's sequences",
        "features": rows,
    }


def features_find_command(
    ref: str,
    sae: str,
    *,
    feature: int | None,
    by: str | None,
    top: int = 10,
    window: int = 8,
    n_tokens: int = 10,
    device: str | None = None,
    runs_dir: str | None = None,
    json_out: bool = False,
    prompt: bool = False,
) -> dict:
    if feature is not None and by is not None:
        raise SpecError("--feature and --by: give one of them")
    for flag, value in (("--top", top), ("--tokens", n_tokens)):
        if value < 1:
            raise SpecError(f"{flag} {value}: expected a whole number >= 1")
    if window < 0:
        raise SpecError(f"--window {window}: expected a whole number >= 0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = open_run(ref, runs_dir, require_complete=True)
    entry = resolve_sae(run, sae)
    if feature is not None:
        out = feature_report(
            run, entry, feature, top=top, window=window, n_tokens=n_tokens, device=device, prompt=prompt
        )
    else:
        out = by_report(run, entry, by, top, prompt)
    if json_out:
        print(json_line(out))
    elif feature is not None:
        _print_feature(out)
    else:
        _print_by(out)
    return out


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _fit_context(context: str, room: int) -> str:
    """A context cut to `room` characters around its [[activating token]], `…` where text was cut."""
    if len(context) <= room:
        return context
    start = context.find("[[")
    end = context.find("]]", start) + 2
    lo = max(0, min(start - (room - (end - start)) // 2, len(context) - room))
    part = context[lo : lo + room]
    if lo > 0:
        part = "…" + part[1:]
    if lo + room < len(context):
        part = part[:-1] + "…"
    return part


def _print_feature(out: dict) -> None:
    """On a terminal each line fits its width: the header and the logit effects wrapped between items,
    each example's context cut around its activating token; piped, one line per item."""
    import textwrap

    from ..analysis.features.find import hook_label

    width = terminal_width()
    where = " prompt" if out.get("positions") == "prompt" else ""

    def emit(text: str, indent: str = "") -> None:
        print(fitted(text, indent, width) if width else text)

    emit(
        f"{out['run_id']}: SAE {out['sae']} ({hook_label(out)}) feature {out['feature']}: active on "
        f"{out['active_tokens']:,} of {out['tokens']:,}{where} tokens (density {out['density']:.4g})"
    )
    if not out["examples"]:
        emit(f"no{where} token of the run has it among its archived top-k latents")
    for e in out["examples"]:
        at = f"pos  {e['position']:>4}" if e["step"] is None else f"step {e['step']:>4}"
        head = f"  {e['activation']:9.4f}  seq {e['sequence']:>5} {at}  "
        context = _one_line(e["context"])
        print(head + (_fit_context(context, max(width - 1 - len(head), 12)) if width else context))
    effects = out["logit_effects"]
    if effects.get("promoted") is None:
        emit(f"logit effects: {effects['note']}")
        return
    for label, key in (("promotes", "promoted"), ("suppresses", "suppressed")):
        items = [f"{_one_line(t['text'])!r} {t['effect']:+.3f}".replace(" ", "\u00a0") for t in effects[key]]
        line = f"{label}: " + "  ".join(items)
        # non-breaking space inside an item: wrapped between items, never inside one
        print((textwrap.fill(line, width, subsequent_indent="  ") if width else line).replace("\u00a0", " "))


def _print_by(out: dict) -> None:
    """Piped: one line per feature, every group. On a terminal: a table at its width, groups left out
    from the right where they do not fit (named below it; --json has them)."""
    from ..archive.groups import group_text

    title = (
        f"{out['run_id']}: SAE {out['sae']}: features whose mean activation per token differs most by "
        f"{out['group_column']} (95 % bootstrap intervals over sequences)"
    )
    if terminal_width() is not None:
        from rich.console import Console

        from ..output.column_fit import print_fitted

        console = Console()
        console.print(title, highlight=False)
        headers = ["feature", "spread", *(group_text(g)[:24] for g in out["groups"])]
        rows = [
            [
                str(r["feature"]),
                f"{r['spread']:.4f}",
                *(f"{g['mean']:.4f} [{g['low']:.4f},{g['high']:.4f}]" for g in r["groups"]),
            ]
            for r in out["features"]
        ]
        print_fitted(console, headers, rows, complete_in="--json has every group", keep=["feature", "spread"])
        return
    print(title)
    head = "  ".join(f"{group_text(g)[:24]:>30}" for g in out["groups"])
    print(f"{'feature':>8} {'spread':>9}  {head}")
    for r in out["features"]:
        cells = "  ".join(f"{g['mean']:9.4f} [{g['low']:8.4f},{g['high']:8.4f}]" for g in r["groups"])
        print(f"{r['feature']:>8} {r['spread']:9.4f}  {cells}")
