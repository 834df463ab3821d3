"""The model's own full forward on a final sequence (eager attention, float32), and the check of
every captured quantity of one sequence against it (the tolerances documented in docs/archive.md)."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers.architectures import frozen_norm

TOL = 1e-4
LENS_BF16_RTOL = 0.02  # documented bound ~1 % (normaliser error <= 0.011 measured on SmolLM2)
# The default capture (preset standard) stores the lens's input residuals in float16 (docs/archive.md,
# "Capture presets"): lens probabilities within 2e-3 (measured max 1.6e-3 over 6,300 rows of SmolLM2),
# the top-1 the reference's except between tokens whose lens logits are within RESID16_BAND of each other
RESID16_PROB_ATOL = 2e-3
RESID16_REL = 2.0**-10  # a product with a float16-rounded residual: within 2^-11 of |x|·|w| per term, doubled


class Reference:
    """The model's own full forward on a final sequence (eager attention, float32)."""

    def __init__(self, model_ref: str, dtype: str = "float32"):
        from lmtrace.runner.models import load_model
        from lmtrace.spec.run_spec import ModelSpec

        self.loaded = load_model(ModelSpec(ref=model_ref, attn_implementation="eager", dtype=dtype))
        self.model = self.loaded.model

    @torch.inference_mode()
    def forward(self, ids: list[int]):
        model = self.model
        last = {}
        layers = model.model.layers
        h1 = layers[-1].register_forward_hook(
            lambda m, a, o: last.__setitem__("resid", (o[0] if isinstance(o, tuple) else o)[0])
        )
        down = {}
        hooks = [
            layers[i].mlp.down_proj.register_forward_pre_hook((lambda i: lambda m, a: down.__setitem__(i, a[0][0]))(i))
            for i in range(len(layers))
        ]
        try:
            out = model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
        finally:
            h1.remove()
            for h in hooks:
                h.remove()
        # resid after layer l: hidden_states[l + 1], except the last one, which is returned normed
        resid = [hs[0].float() for hs in out.hidden_states[1:-1]] + [last["resid"].float()]
        return {
            "logits": out.logits[0].float(),
            "attn": [a[0].float() for a in out.attentions],  # [H, T, T]
            "resid": resid,  # per layer [T, d]
            "embed": out.hidden_states[0][0].float(),
            "ffn_act": [down[i].float() for i in range(len(layers))],  # [T, d_ffn]
        }


def sequence_ids(run, seq):
    """A sequence's token ids, prompt and generated, and its generated rows of tokens.parquet by step."""
    t = run.tokens().to_pandas()
    t = t[t.sequence == seq].sort_values("position")
    return t.token_id.tolist(), t[~t.is_prompt].sort_values("step")


def check_sequence(run, ref: Reference, seq: int, tol: float = TOL) -> int:
    """Compare every captured quantity of one sequence with the reference. Returns steps checked."""
    lens_exact = run.manifest["lens"]["dtype"] == "float32"
    resid16 = run.manifest["spec_resolved"]["capture"]["residual"]["dtype"] == "float16"
    ids, gen = sequence_ids(run, seq)
    P = int(run.prompt_len()[seq])
    n = int(run.generated_len()[seq])
    assert len(gen) == n and len(ids) == P + n
    r = ref.forward(ids)
    layers = run.layers
    steps = run.steps().to_pandas()
    steps = steps[steps.sequence == seq]
    attn = run.array("attn")[seq] if "attn" in run.array_names() else None
    lens_ids = run.array("lens_ids")[seq]
    lens_probs = run.array("lens_probs")[seq]
    ffn_idx, ffn_val = run.array("ffn_idx")[seq], run.array("ffn_val")[seq]
    W = ref.model.lm_head.weight.float()
    W_norm = W.norm(dim=-1)  # per token
    norm = ref.model.model.norm
    lens_ranks: dict[int, list] = {}
    for s in range(n):
        qpos = P - 1 + s
        row = gen.iloc[s]
        # chosen-token logprob, entropy and alternatives at T=1
        logprobs = r["logits"][qpos].log_softmax(-1)
        assert row.token_id == ids[P + s]
        assert abs(row.logprob - logprobs[row.token_id].item()) < tol
        top = logprobs.topk(len(row.alt_ids))
        assert list(row.alt_ids[:3]) == top.indices[:3].tolist()
        np.testing.assert_allclose(row.alt_logprobs, top.values.numpy(), atol=tol)
        ent = -(logprobs.exp() * logprobs).sum().item()
        assert abs(row.entropy - ent) < 10 * tol
        st = steps[steps.step == s].sort_values("layer")
        t2 = r["logits"][qpos].topk(2).indices
        margin_row, x_final = W[t2[0]] - W[t2[1]], r["resid"][-1][qpos]
        if len(layers) == len(r["resid"]):  # every layer: with the embedding's share they sum to the logit margin
            total = st.margin_contrib.sum() + (frozen_norm(norm, x_final, r["embed"][qpos]) @ margin_row).item()
            margin = (r["logits"][qpos][t2[0]] - r["logits"][qpos][t2[1]]).item()
            assert abs(total - margin) < tol * max(1.0, abs(margin)) * 10, (s, total, margin)
            assert abs(row.margin - margin) < tol * max(1.0, abs(margin)) * 10  # tokens.parquet's margin
        order = logprobs.topk(2).indices.tolist()
        runner = order[1] if order[0] == row.token_id else order[0]  # the runner-up: the best other token
        for li, layer in enumerate(layers):
            # attention row of the query position over every key so far
            if attn is not None:
                expected = r["attn"][layer][:, qpos, : qpos + 1].numpy()
                got = attn[s, li, :, : qpos + 1].astype(np.float32)
                np.testing.assert_allclose(got, expected, atol=tol)
                assert np.isnan(attn[s, li, :, qpos + 1 :]).all()
            # residual norms and deltas
            resid = r["resid"][layer][qpos]
            before = r["resid"][layer - 1][qpos] if layer > 0 else r["embed"][qpos]
            assert abs(st.resid_norm.iloc[li] - resid.norm().item()) < tol * max(1.0, resid.norm().item())
            assert abs(st.delta_norm.iloc[li] - (resid - before).norm().item()) < tol * max(1.0, resid.norm().item())
            # logit lens: final norm + unembedding of this layer's residual
            normed = norm(resid[None])[0].float()
            lens_logits = normed @ W.T
            absdot = (
                normed.norm() * W_norm
            ).numpy()  # ≥ Σ|x_i·w_i| (Cauchy-Schwarz): bounds a product's rounding, per token
            lens = lens_logits.log_softmax(-1)
            lt = lens.topk(lens_ids.shape[-1])
            if resid16:  # the lens of a float16-rounded residual: a near tie may swap the top-1
                band16 = RESID16_REL * 2 * absdot[lt.indices[0].item()]
                got_top = int(lens_ids[s, li, 0])
                assert lens_logits[got_top] >= lens_logits[lt.indices[0]] - band16, (s, layer)
                np.testing.assert_allclose(
                    np.sort(lens_probs[s, li])[::-1], lt.values.exp().numpy(), atol=RESID16_PROB_ATOL
                )
            else:
                assert lens_ids[s, li, 0] == lt.indices[0].item()
            if resid16:
                pass
            elif lens_exact:
                np.testing.assert_allclose(lens_probs[s, li], lt.values.exp().numpy(), atol=tol)
            else:
                assert set(lens_ids[s, li].tolist()) == set(lt.indices.tolist())
                np.testing.assert_allclose(lens_probs[s, li], lt.values.exp().numpy(), rtol=LENS_BF16_RTOL, atol=1e-6)
            top2 = lens_logits.topk(2).values
            if resid16:
                assert (
                    abs(st.lens_margin.iloc[li] - (top2[0] - top2[1]).item())
                    < 4 * RESID16_REL * absdot.max() + tol * 10
                )
                assert st.lens_top1.iloc[li] == lens_ids[s, li, 0]
            else:
                assert abs(st.lens_margin.iloc[li] - (top2[0] - top2[1]).item()) < tol * 10
                assert st.lens_top1.iloc[li] == lt.indices[0].item()
            # the chosen token's and the runner-up's (the model's most likely other token) lens rank and prob
            # (numpy: comparisons over the vocabulary are several times cheaper than torch's here)
            logits_np, lens_np = lens_logits.numpy(), lens.numpy()
            for tok, rank_col, prob_col in (
                (row.token_id, "lens_target_rank", "lens_target_prob"),
                (runner, "lens_runner_up_rank", "lens_runner_up_prob"),
            ):
                diff = logits_np - logits_np[tok]
                want_rank = int(np.count_nonzero(diff > 0))
                got_rank = int(st[rank_col].iloc[li])
                # A token whose logit is within rounding of the target's may land on either side: the
                # archived residual differs from this forward's by ~1e-5 relative, and in bfloat16 mode
                # tokens outside the re-scored candidates are compared by their bfloat16 logits (2^-8
                # relative per product term). Elsewhere the rank is exact.
                band = (2.0**-7 if not lens_exact else RESID16_REL if resid16 else 1e-4) * (absdot + absdot[tok])
                lo, hi = int(np.count_nonzero(diff > band)), int(np.count_nonzero(diff > -band)) - 1
                assert lo <= got_rank <= hi, (s, layer, rank_col, got_rank, want_rank, lo, hi)
                assert abs(st[prob_col].iloc[li] - np.exp(lens_np[tok])) <= tol + (
                    RESID16_PROB_ATOL if resid16 else 0 if lens_exact else LENS_BF16_RTOL * np.exp(lens_np[tok])
                ), (s, layer, prob_col)
                if rank_col == "lens_target_rank":  # (checked just above against this forward's ranks)
                    lens_ranks.setdefault(s, []).append(got_rank)
            # margin contribution of this layer's delta to the final top-1 vs top-2 logit difference
            # (through the final norm, its scale frozen at the final residual)
            contrib = (frozen_norm(norm, x_final, resid - before) @ margin_row).item()
            assert abs(st.margin_contrib.iloc[li] - contrib) < tol * max(1.0, abs(contrib)) * 10
            # FFN top-k of the intermediate activation, signed
            act = r["ffn_act"][layer][qpos]
            k = ffn_idx.shape[-1]
            top_abs = act.abs().topk(k).indices
            assert set(ffn_idx[s, li].tolist()) == set(top_abs.tolist())
            np.testing.assert_allclose(ffn_val[s, li], act[ffn_idx[s, li]].numpy(), rtol=1e-5, atol=tol)
            assert np.all(np.diff(np.abs(ffn_val[s, li])) <= 0)  # in descending order of |a| (docs/archive.md)
        # settle layer: the first captured layer from which the chosen token stays the lens's top-1
        chosen_ranks = lens_ranks[s]
        want_settle = -1
        for li in range(len(layers) - 1, -1, -1):
            if chosen_ranks[li] != 0:
                break
            want_settle = layers[li]
        assert (st.settle_layer == want_settle).all(), (s, st.settle_layer.tolist(), want_settle, chosen_ranks)
        # the last layer's lens is the model's own output distribution
        if layers[-1] == len(r["resid"]) - 1:
            np.testing.assert_allclose(
                np.sort(lens_probs[s, -1])[::-1],
                logprobs.topk(lens_probs.shape[-1]).values.exp().numpy(),
                atol=RESID16_PROB_ATOL if resid16 else tol,
                rtol=0 if lens_exact else LENS_BF16_RTOL,
            )
    return n
