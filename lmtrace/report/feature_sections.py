"""The report's features (docs/report.md, "Features"): a snapshot of `lmtrace serve`'s feature pages
for the latents most active on the tokens the report shows.

Per SAE of the run (its archived `feat_<sae>_idx` / `_val`), the `TOP_FEATURES` latents with the
largest archived activation over the shown steps of the shown sequences; each latent's page is serve's
answer (`viewdata.features.feature_page`) restricted to the report's sequences: its top examples from
within them, their density and histogram, and its logit effects where `lmtrace features --feature`
kept them. The answers are inlined as JSON and drawn by serve's own script (features.js); the token
view's feature list links to the pages embedded here.
"""

from __future__ import annotations

import json

import numpy as np

from ..viewdata.features import feature_page as page_answer
from ..viewdata.features import hook_label, sae_entries
from ..viewdata.queries import steps_ready
from .run_data import RunData
from .sections import Section, esc
from .selection import Selection
from .token_view import rounded

TOP_FEATURES = 6  # latents per SAE embedded
EXAMPLES = 10  # examples per latent
DATA_ID = "lmtrace-features"


def shown_top_features(data: RunData, sel: Selection, entry: dict, n: int = TOP_FEATURES) -> list[int]:
    """The `n` latents of the SAE with the largest archived activation over the shown tokens (ties: the
    smaller id first)."""
    run, best = data.run, {}
    idx_a, val_a = run.array(f"feat_{entry['name']}_idx"), run.array(f"feat_{entry['name']}_val")
    for seq in sel.sequences:
        steps = [s for s in sel.steps.get(seq, []) if s < steps_ready(run, seq)]
        if not steps:
            continue
        ids = np.asarray(idx_a[seq])[steps]
        vals = np.asarray(val_a[seq], dtype=np.float64)[steps]
        for i, v in zip(ids[ids >= 0].tolist(), vals[ids >= 0].tolist()):
            best[i] = max(best.get(i, -np.inf), v)
    return [f for f, _ in sorted(best.items(), key=lambda x: (-x[1], x[0]))[:n]]


def features_section(data: RunData, sel: Selection) -> Section | None:
    """None when the run has no feature arrays."""
    entries = sae_entries(data.run)
    if not entries:
        return None
    sec = Section("features", "Features")
    answers: dict[str, dict] = {}
    parts = [
        "<p class='legend'>Per SAE, the latents most active on the tokens shown (their largest archived "
        "activation), each as <code>lmtrace serve</code>'s feature page over this report's sequences: "
        "its top activating tokens with their context (coloured by the latent's activation; the "
        "activating token outlined; click one for it in the token view), its density and histogram, "
        "and its logit effects where <code>lmtrace features RUN --sae NAME --feature F</code> computed them.</p>"
    ]
    for entry in entries:
        chosen = shown_top_features(data, sel, entry)
        parts.append(f"<h3>SAE <code>{esc(entry['name'])}</code> · {esc(hook_label(entry))}</h3>")
        if not chosen:
            parts.append("<p class='note'>no latent archived active on the tokens shown</p>")
            continue
        parts.append(
            "<p class='feature-index'>latents: "
            + " ".join(f"<a href='#{feature_anchor(entry['name'], f)}'>{f}</a>" for f in chosen)
            + "</p>"
        )
        for f in chosen:
            answers[f"features/{entry['name']}/{f}"] = rounded(
                page_answer(data.run, entry["name"], f, top=EXAMPLES, sequences=sel.sequences)
            )
            parts.append(
                f"<div class='tokenview feature-snap' id='{feature_anchor(entry['name'], f)}' "
                f"data-sae='{esc(entry['name'])}' data-feature='{f}'><h3>feature {f}</h3></div>"
            )
    payload = json.dumps({"answers": answers}, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    parts.append(f"<script type='application/json' id='{DATA_ID}'>{payload}</script>")
    sec.html = "".join(parts)
    sec.notes.append(
        f"the {TOP_FEATURES} most active latents per SAE on the tokens shown, {EXAMPLES} examples each from "
        f"the sequences shown; `lmtrace serve` has every latent's page over the whole run"
    )
    return sec


def feature_anchor(sae: str, feature: int) -> str:
    """The id of a latent's block in the page: feature-<sae, other characters than letters and digits as
    their code>-<feature> (inlined_source.js finds the blocks by their data-sae and data-feature)."""
    safe = "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):x}_" for c in sae)
    return f"feature-{safe}-{feature}"
