"""Whether two runs can be compared, how their specs and prompts differ, and which sequences pair.

The sides `A` and `B` taken here are `sides.Side` objects (a run reader with its tokens read per sequence)."""

from __future__ import annotations

from ...archive import layout
from ...archive.reader import LENS_NOT_COMPUTED
from ...archive.runs import lens_state
from ...archive.summary import edit_label
from ...exits.errors import ArchiveError, SpecError

PAIRING_MODES = ("auto", "index", "prompt")
MANIFEST_RUN_KEYS = ("kind", "interventions", "mode", "from_step")
MAX_PROMPT_DIFFS = 20  # prompt texts listed one by one in the spec differences


class IncomparableRunsError(ArchiveError):
    """The two runs cannot be compared (different tokenizers, unknown archive format)."""


def compatibility(A, B) -> dict:
    ma, mb = A.run.manifest, B.run.manifest
    for side in (A, B):
        if side.run.manifest.get("format_version") not in layout.READABLE_FORMAT_VERSIONS:
            raise IncomparableRunsError(
                f"run {side.label} ({side.run.id}) has archive format "
                f"{side.run.manifest.get('format_version')!r}; this lmtrace reads formats "
                f"{', '.join(map(str, layout.READABLE_FORMAT_VERSIONS))}"
            )
    ta, tb = ma.get("tokenizer") or {}, mb.get("tokenizer") or {}
    if ta.get("vocab_size") != tb.get("vocab_size"):
        raise IncomparableRunsError(
            f"runs use different tokenizers ({ta.get('class')} with {ta.get('vocab_size')} tokens vs "
            f"{tb.get('class')} with {tb.get('vocab_size')}): token ids, top-k lists and texts cannot be compared"
        )
    shared = sorted(set(A.token_text) & set(B.token_text))
    conflicts = [i for i in shared if A.token_text[i] != B.token_text[i]]
    if conflicts:
        ex = ", ".join(f"id {i}: {A.token_text[i]!r} vs {B.token_text[i]!r}" for i in conflicts[:3])
        raise IncomparableRunsError(
            f"runs use different tokenizers: {len(conflicts)} token id(s) decode differently "
            f"({ex}); token ids cannot be compared"
        )
    notes = []
    if ta.get("class") != tb.get("class"):
        notes.append(
            f"tokenizer classes differ ({ta.get('class')} vs {tb.get('class')}) but the vocabulary size "
            f"and all {len(shared)} token texts seen in both runs agree: compared as one tokenizer"
        )
    if not shared:
        notes.append("the runs share no token ids, so token texts could not be cross-checked")
    ca = (ma.get("model") or {}).get("config") or {}
    cb = (mb.get("model") or {}).get("config") or {}
    if ca.get("vocab_size") != cb.get("vocab_size"):
        notes.append(
            f"model vocabularies differ in size ({ca.get('vocab_size')} vs {cb.get('vocab_size')}): "
            f"distributions cover different id ranges"
        )
    sa, sb = ma["shape"], mb["shape"]
    arch_keys = ("n_heads", "n_kv_heads", "head_dim", "d_model")
    same_arch = ca.get("num_hidden_layers") == cb.get("num_hidden_layers") and all(
        sa.get(k) == sb.get(k) for k in arch_keys
    )
    if not same_arch:
        notes.append("the models differ in shape (layers, heads or width): per-layer and per-head figures are skipped")
    wa, wb = (ma.get("model") or {}).get("weights_sha256"), (mb.get("model") or {}).get("weights_sha256")
    same_weights = wa is not None and wa == wb
    common_layers = [x for x in sa["layers"] if x in sb["layers"]] if same_arch else []
    if same_arch and not common_layers:
        notes.append("the runs captured no layer in common: per-layer figures are skipped")
    for side in (A, B):
        if side.steps is None and same_arch:
            notes.append(f"run {side.label} has no per-layer table (capture: none): per-layer figures are skipped")
        elif side.steps is not None and lens_state(side.run.manifest) == "pending":
            notes.append(
                f"run {side.label}: " + LENS_NOT_COMPUTED.format(run_id=side.run.id) + " to include lens winner changes"
            )
    return {
        "tokenizer": {
            "class_a": ta.get("class"),
            "class_b": tb.get("class"),
            "vocab_size": ta.get("vocab_size"),
            "token_ids_cross_checked": len(shared),
        },
        "model_vocab_size": [ca.get("vocab_size"), cb.get("vocab_size")],
        "same_architecture": same_arch,
        "same_weights": same_weights,
        "common_layers": common_layers if (A.steps is not None and B.steps is not None) else [],
        "notes": notes,
    }


def _flatten(d, prefix: str = "") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def spec_differences(ma: dict, mb: dict) -> list[dict]:
    """Resolved-spec keys that differ (output.* excluded), the prompt texts one by one, plus weights and tokenizer."""
    fa, fb = _flatten(ma.get("spec_resolved") or {}), _flatten(mb.get("spec_resolved") or {})
    out = []
    for key in sorted(set(fa) | set(fb)):
        if key.startswith("output."):
            continue
        if key == "prompts.texts":
            out += prompt_differences(fa.get(key), fb.get(key))
            continue
        if fa.get(key) != fb.get(key):
            out.append({"key": key, "a": fa.get(key), "b": fb.get(key)})
    wa, wb = (ma.get("model") or {}).get("weights_sha256"), (mb.get("model") or {}).get("weights_sha256")
    if wa != wb:
        out.append({"key": "model.weights_sha256", "a": (wa or "")[:16] or None, "b": (wb or "")[:16] or None})
    ta, tb = (ma.get("tokenizer") or {}).get("sha256"), (mb.get("tokenizer") or {}).get("sha256")
    if ta and tb and ta != tb:  # e.g. a model directory whose tokenizer files changed (absent in older runs)
        out.append({"key": "tokenizer.sha256", "a": ta[:16], "b": tb[:16]})
    for key in MANIFEST_RUN_KEYS:  # how the run was made beyond its spec (e.g. an intervention child)
        va, vb = ma.get(key), mb.get(key)
        if va != vb:
            out.append({"key": key, "a": _short(va), "b": _short(vb)})
    return out


def prompt_differences(ta, tb) -> list[dict]:
    """Prompt texts that differ: `prompts.texts[i]` per index (null = absent on that side), or one
    `prompts.order` entry when both runs hold the same texts in another order."""
    if ta == tb:
        return []
    if not (isinstance(ta, list) and isinstance(tb, list)):
        return [{"key": "prompts.texts", "a": ta, "b": tb}]
    if sorted(map(str, ta)) == sorted(map(str, tb)):
        return [
            {
                "key": "prompts.order",
                "a": "as in A",
                "b": "the same texts reordered: "
                + ", ".join(str(ta.index(t)) for t in tb)
                + " (A's index of each of B's prompts)",
            }
        ]
    out = []
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x != y:
            out.append({"key": f"prompts.texts[{i}]", "a": x, "b": y})
    if len(out) > MAX_PROMPT_DIFFS:
        more = len(out) - MAX_PROMPT_DIFFS
        out = out[:MAX_PROMPT_DIFFS] + [
            {"key": "prompts.texts[…]", "a": f"{more} more differ", "b": f"{more} more differ"}
        ]
    return out


def _short(value):
    """A list of edit records as one line in the CLI's words, as `lmtrace ls` writes them
    (`ablate-head 2.1 from 3; mask-positions 0-4`); other values unchanged."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "; ".join(edit_label(v) for v in value)
    return value


def pair_sequences(prompts_a: list[str | None], prompts_b: list[str | None], mode: str = "auto") -> dict:
    """Pairs (seq_a, seq_b) by index or by prompt text; which were made and which were left unpaired."""
    if mode not in PAIRING_MODES:
        raise SpecError(f"--pair must be one of {', '.join(PAIRING_MODES)} (got {mode!r})")
    na, nb = len(prompts_a), len(prompts_b)
    if mode == "auto":
        same = na == nb and all(x == y or x is None or y is None for x, y in zip(prompts_a, prompts_b))
        mode = "index" if same else "prompt"
    pairs: list[tuple[int, int]] = []
    if mode == "index":
        pairs = [(i, i) for i in range(min(na, nb))]
    else:
        used: set[int] = set()
        for i, text in enumerate(prompts_a):
            if text is None:
                continue
            for j, other in enumerate(prompts_b):
                if j not in used and other == text:
                    pairs.append((i, j))
                    used.add(j)
                    break
    pa_ = {i for i, _ in pairs}
    pb_ = {j for _, j in pairs}
    return {
        "method": mode,
        "pairs": pairs,
        "unpaired_a": [i for i in range(na) if i not in pa_],
        "unpaired_b": [j for j in range(nb) if j not in pb_],
    }
