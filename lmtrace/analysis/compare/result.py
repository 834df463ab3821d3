"""The result of a comparison (`Comparison`): run summaries, pairing, per-pair summaries, the
per-step / per-layer / per-head tables, the rankings and the verdict; its JSON form and its tables.
`DEFINITIONS` states what each figure means (repeated in the JSON, detailed in docs/compare.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from ...output.jsonout import strict
from .divergence import TAIL_FLOOR

JSON_MAX_STEP_ROWS = 20000  # larger per-step tables go to --out only

DEFINITIONS = {
    "pairing": "by index when both runs have the same prompt texts in the same order, else by prompt text "
    "(k-th occurrence with k-th occurrence)",
    "context_identical": "same prompt token ids and same generated ids before the step; holds up to and including "
    "the first divergence step",
    "first_divergence": "first step whose chosen tokens differ (kind 'token'), or where one side stopped and the "
    "other continued (kind 'length'); prompts with different token ids never share a context",
    "logprob_x_under_y": "logprob of side x's token in side y's distribution (T=1), known only if it is in y's "
    "stored top-k or is y's own token; null otherwise",
    "kl_js": "nats, on the partition {each token whose logprob is stored on both sides} + {one tail bucket with "
    "everything else}; exact for that partition, a lower bound of the full-vocabulary value; tail masses "
    f"floored at {TAIL_FLOOR:g}",
    "deltas": "B minus A",
    "attn_js": "Jensen-Shannon divergence (nats) between the two sides' attention rows of a head over the shared "
    "context keys (rows renormalised; top-k rows use the stored-on-both + tail partition)",
    "after_divergence": "per-side figures only (each side saw its own text): not paired, not differences",
    "exact": "--exact only: KL/JS over the full vocabulary and logit differences (B − A), from each side's model "
    "(float32, eager, an intervention child's edits replayed) rescoring the shared context",
}


@dataclass
class Comparison:
    """Two runs compared, as `compare_runs` returns it; `summary()` is the JSON form, `tables()` the tables."""

    a: dict
    b: dict
    compatibility: dict
    spec_differences: list[dict]
    pairing: dict
    pairs: list[dict]
    per_step: pa.Table
    per_layer: pa.Table
    per_head: pa.Table
    layers: list[dict]
    heads: list[dict]
    first_changed_layer: int | None
    identical: bool
    verdict: str
    notes: list[str] = field(default_factory=list)

    def summary(self, *, include_steps: bool = True) -> dict:
        """Everything as JSON-ready values: per-pair summaries, rankings, and the per-step table."""
        out = {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "verdict": self.verdict,
            "compatibility": self.compatibility,
            "spec_differences": self.spec_differences,
            "pairing": {
                **self.pairing,
                "pairs": [{"pair": i, "seq_a": x, "seq_b": y} for i, (x, y) in enumerate(self.pairing["pairs"])],
            },
            "definitions": DEFINITIONS,
            "notes": self.notes,
            "pairs": self.pairs,
            "first_changed_layer": self.first_changed_layer,
            "layers": self.layers,
            "heads": self.heads,
        }
        if include_steps and self.per_step.num_rows <= JSON_MAX_STEP_ROWS:
            out["per_step"] = self.per_step.to_pylist()
        elif include_steps:
            out["per_step"] = None
            out["notes"] = self.notes + [
                f"per_step has {self.per_step.num_rows} rows: left out of the JSON, "
                f"written by --out DIR as per_step.parquet"
            ]
        return strict(out)

    def tables(self) -> dict[str, pa.Table]:
        """The tables `--out DIR` writes, by file stem: per_step, per_layer, per_head, pairs."""
        return {
            "per_step": self.per_step,
            "per_layer": self.per_layer,
            "per_head": self.per_head,
            "pairs": pairs_table(self.pairs),
        }


def pairs_table(pairs: list[dict]) -> pa.Table:
    """One row per sequence pair: its divergence, paired-figure means and texts (pairs.parquet)."""
    rows = []
    for p in pairs:
        d = p.get("first_divergence") or {}
        f = p.get("paired_figures") or {}
        rows.append(
            {
                "pair": p["pair"],
                "seq_a": p["seq_a"],
                "seq_b": p["seq_b"],
                "matched_by": p["matched_by"],
                "prompt": p["prompt"],
                "same_prompt_ids": p["same_prompt_ids"],
                "generated_len_a": p["generated_len_a"],
                "generated_len_b": p["generated_len_b"],
                "paired_steps": p["paired_steps"],
                "first_divergence_step": d.get("step"),
                "divergence_kind": d.get("kind"),
                "token_a": (d.get("token_a") or {}).get("id"),
                "token_b": (d.get("token_b") or {}).get("id"),
                "mean_kl_ab": f.get("mean_kl_ab"),
                "mean_js": f.get("mean_js"),
                "max_js": f.get("max_js"),
                "top1_agreement": f.get("top1_agreement"),
                "text_common": p["text"]["common"],
                "text_a": p["text"]["a"],
                "text_b": p["text"]["b"],
                "step0_logit_diff_under_a": (p.get("step0_logit_diff") or {}).get("under_a"),
                "step0_logit_diff_under_b": (p.get("step0_logit_diff") or {}).get("under_b"),
            }
        )
    schema = pa.schema(
        [
            ("pair", pa.int32()),
            ("seq_a", pa.int32()),
            ("seq_b", pa.int32()),
            ("matched_by", pa.string()),
            ("prompt", pa.string()),
            ("same_prompt_ids", pa.bool_()),
            ("generated_len_a", pa.int32()),
            ("generated_len_b", pa.int32()),
            ("paired_steps", pa.int32()),
            ("first_divergence_step", pa.int32()),
            ("divergence_kind", pa.string()),
            ("token_a", pa.int32()),
            ("token_b", pa.int32()),
            ("mean_kl_ab", pa.float64()),
            ("mean_js", pa.float64()),
            ("max_js", pa.float64()),
            ("top1_agreement", pa.float64()),
            ("text_common", pa.string()),
            ("text_a", pa.string()),
            ("text_b", pa.string()),
            ("step0_logit_diff_under_a", pa.float64()),
            ("step0_logit_diff_under_b", pa.float64()),
        ]
    )
    return pa.Table.from_pylist(strict(rows), schema=schema)
