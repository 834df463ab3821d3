"""Which layers a comparison calls changed: a layer's own values, not its direct-logit contribution read
through a final norm that a later layer's change rescales."""

from __future__ import annotations

import pyarrow as pa

from lmtrace.analysis.compare.ranking import rank_layers


def _per_layer(margin_delta: list[float], resid_delta: list[float]) -> pa.Table:
    n = len(margin_delta)
    zeros, ones = [0.0] * n, [1.0] * n
    return pa.table(
        {
            "layer": list(range(n)),
            "delta_norm_delta": resid_delta,
            "delta_norm_a": ones,
            "resid_norm_delta": resid_delta,
            "resid_norm_a": ones,
            "attn_norm_delta": zeros,
            "mlp_norm_delta": zeros,
            "attn_js_mean": zeros,
            "attn_js_max": zeros,
            "lens_changed": [0.0] * n,
            "margin_contrib_delta": margin_delta,
            "same_final_top2": [True] * n,
            "resid_dist": [abs(v) for v in resid_delta],
        }
    )


def test_a_layer_whose_only_difference_is_its_margin_contribution_is_not_changed():
    """An edit at layer 2: layers 0 and 1 computed the same values, but the final norm's new scale moves
    their direct-logit margin contributions."""
    rows = rank_layers(_per_layer(margin_delta=[0.01, 0.02, 0.3, 0.1], resid_delta=[0.0, 0.0, 0.5, 0.2]))
    changed = {r["layer"]: r["changed"] for r in rows}
    assert changed == {0: False, 1: False, 2: True, 3: True}
    assert {r["layer"]: r["margin_contrib_abs_delta"] for r in rows}[0] == 0.01  # still reported
