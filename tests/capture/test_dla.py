"""Per-head direct logit attribution (`capture.head_dla`) against the test's own hook-based computation.

The reference is a plain transformers forward (eager attention, float32) over the final sequence,
with forward hooks placed from the tests' own `Case` table (tests/helpers/architectures.py): each head's output is
its slice of the output projection's input times its slice of the projection's weight, and the final
norm is frozen at the scale the final residual actually has (σ computed here from the norm module's
own weight / bias / eps). Where a block normalises its attention and MLP outputs before the residual
add (Gemma 2/3, OLMo2), the reference hooks those norms too: a head's part is scaled by the norm's gain
over the RMS of the whole attention output (the norm's input, computed here), and the layer's attention
and MLP parts are the norms' own outputs. The sum identity is checked against the model's own logits.

The margin contributions (steps.parquet `margin_contrib`) are checked the same way: each layer's
change to the residual through the final norm frozen at the final residual, projected on the final
top-1 − top-2 unembedding rows; with the embedding's share and the biases they sum to the model's
own top-1 − top-2 logit difference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.architectures import BY_ID, OPT, Case, D, FullForward, build_tiny, frozen_norm
from tests.helpers.architectures import attr_path as _get
from tests.helpers.architectures import hf_config as _cfg
from tests.helpers.runs import run_spec

CAPTURE = {
    "attention": {"enabled": False},
    "qkv": False,
    "ffn": {"enabled": False},
    "lens": {"enabled": False},
    "component_norms": False,
    "margin_contributions": False,
    "head_dla": True,
}
PROMPTS = ["The quick brown fox", "One, two, three, four,"]


def _spec(model: str, n: int = 3) -> dict:
    return {
        "model": model,
        "prompts": PROMPTS,
        "capture": CAPTURE,
        "generation": {"max_new_tokens": n, "batch_size": 2, "temperature": 0.0},
    }


class Attribution:
    """The test's own DLA of one final sequence, at every position, from a FullForward."""

    def __init__(self, ref: FullForward, ids: list[int]):
        self.ref, self.blocks = ref, ref.blocks
        cfg = getattr(ref.model.config, "text_config", None) or ref.model.config
        self.H = cfg.num_attention_heads
        # the outputs of the blocks' attention- and MLP-output norms, where the case has them
        self.post = {path: {} for path in POST_NORMS.get(ref.case.id, ())}
        hooks = [
            _get(block, path).register_forward_hook(
                lambda m, a, out, store=store, i=i: store.__setitem__(i, out[0].float())
            )
            for path, store in self.post.items()
            for i, block in enumerate(self.blocks)
        ]
        try:
            self.out = ref.run(ids)
        finally:
            for h in hooks:
                h.remove()

    def _through_final(self, pos: int, parts: torch.Tensor) -> torch.Tensor:
        """parts [..., d] -> their (frozen-norm) images in the unembedding's input space."""
        return self.ref.through_final(self.out["resid"][-1][pos], parts)

    def head_outputs(self, layer: int, pos: int) -> torch.Tensor:
        """[H, d]: each head's output written to the residual stream (its o_proj slice, no bias)."""
        o = _get(self.blocks[layer], self.ref.case.o_proj)
        z = self.out["o_in"][layer][pos]  # [H*D]
        D = z.shape[0] // self.H
        w = o.weight.float()
        w_o = w if isinstance(o, torch.nn.Linear) else w.T  # GPT-2's Conv1D stores [in, out]
        heads = torch.stack([w_o[:, h * D : (h + 1) * D] @ z[h * D : (h + 1) * D] for h in range(self.H)])
        if self.post:  # the attention-output norm, its scale frozen at the whole attention output (its input)
            heads = frozen_norm(
                _get(self.blocks[layer], POST_NORMS[self.ref.case.id][0]), self.out["attn_out"][layer][pos], heads
            )
        return heads

    def block_parts(self, layer: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[d], [d]: what the layer's attention and MLP add to the residual stream (the post-norms' own
        outputs where the block has them)."""
        if self.post:
            attn_norm, mlp_norm = POST_NORMS[self.ref.case.id]
            return self.post[attn_norm][layer][pos], self.post[mlp_norm][layer][pos]
        return self.out["attn_out"][layer][pos], self.out["mlp_out"][layer][pos]

    def head_dla(self, pos: int, chosen: int, runner_up: int) -> np.ndarray:
        W = self.ref.model.lm_head.weight.float()
        direction = W[chosen] - W[runner_up]
        L = len(self.blocks)
        return np.stack(
            [(self._through_final(pos, self.head_outputs(layer, pos)) @ direction).numpy() for layer in range(L)]
        )

    def block_dla(self, pos: int, chosen: int, runner_up: int) -> np.ndarray:
        """[layer, 2]: each layer's attention and MLP parts, attributed to logit(chosen) − logit(runner-up)."""
        W = self.ref.model.lm_head.weight.float()
        direction = W[chosen] - W[runner_up]
        return np.stack(
            [
                (self._through_final(pos, torch.stack(self.block_parts(layer, pos))) @ direction).numpy()
                for layer in range(len(self.blocks))
            ]
        )


def _greedy_steps(run, seq: int):
    t = run.tokens().to_pandas()
    t = t[t.sequence == seq].sort_values("position")
    return t.token_id.tolist(), t[~t.is_prompt].sort_values("step")


def _check_against_reference(run, ref: FullForward, atol: float) -> None:
    for seq in range(len(PROMPTS)):
        ids, gen = _greedy_steps(run, seq)
        att = Attribution(ref, ids)
        logits = att.out["logits"]
        prompt_len = len(ids) - len(gen)
        for step, row in zip(gen.step.astype(int).tolist(), gen.itertuples()):
            pos = prompt_len + step - 1
            top2 = logits[pos].topk(2).indices.tolist()  # greedy: the chosen token and the runner-up
            assert top2[0] == row.token_id
            assert int(run.array("dla_runner_up")[seq, step]) == top2[1]
            got = run.array("head_dla")[seq, step]
            np.testing.assert_allclose(
                got, att.head_dla(pos, *top2), atol=atol, rtol=0, err_msg=f"head_dla sequence {seq} step {step}"
            )
            blocks = att.block_dla(pos, *top2)
            np.testing.assert_allclose(
                run.array("attn_dla")[seq, step],
                blocks[:, 0],
                atol=atol,
                rtol=0,
                err_msg=f"attn_dla sequence {seq} step {step}",
            )
            np.testing.assert_allclose(
                run.array("mlp_dla")[seq, step],
                blocks[:, 1],
                atol=atol,
                rtol=0,
                err_msg=f"mlp_dla sequence {seq} step {step}",
            )


def _sum_identity(run, tol: float) -> None:
    """embedding + Σ attention + Σ MLP + constant + rest = the model's final logit difference (tokens.parquet
    `margin`, greedy) and final chosen logit (`alt_logits[0]`), per step; rest ≈ 0 with every layer captured."""
    tok = run.tokens().to_pandas()
    gen = tok[~tok.is_prompt]
    for suffix, target in (("", lambda r: r.margin), ("_logit", lambda r: r.alt_logits[0])):
        total = (
            run.array("embed_dla" + suffix)[:]
            + run.array("attn_dla" + suffix)[:].sum(-1)
            + run.array("mlp_dla" + suffix)[:].sum(-1)
            + run.array("bias_dla" + suffix)[:]
            + run.array("rest_dla" + suffix)[:]
        )
        for r in gen.itertuples():
            expected = float(target(r))
            assert abs(total[r.sequence, int(r.step)] - expected) <= tol * max(1.0, abs(expected)), (
                suffix,
                r.sequence,
                r.step,
            )
        rest = run.array("rest_dla" + suffix)[:]
        scale = np.abs(run.array("attn_dla" + suffix)[:]).max()
        assert np.nanmax(np.abs(rest)) <= 1e-4 * max(1.0, scale), "a part of the residual stream was not attributed"


# blocks that normalise the attention and MLP outputs before the residual add: (attention norm, MLP norm)
POST_NORMS = {
    case: ("post_attention_layernorm", "post_feedforward_layernorm") for case in ("gemma2_uncapped", "gemma3", "olmo2")
}
# Gemma 2 without final logit soft-capping (the tiny `gemma2` case keeps Gemma 2's default cap of 30)
GEMMA2_UNCAPPED = Case(
    "gemma2_uncapped",
    "gemma",
    _cfg("Gemma2Config", **D, num_key_value_heads=2, head_dim=16, sliding_window=4, final_logit_softcapping=None),
    "",
)


def build_with_random_norms(case: Case, tokenizer, path: Path) -> Path:
    """build_tiny, then every norm weight drawn at random (initialised to 0 or 1 they would hide a wrong
    gain, Gemma's 1 + weight against weight)."""
    from transformers import AutoModelForCausalLM

    build_tiny(case, tokenizer, path)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))
    model.save_pretrained(path)
    return path


# pre-LN OPT with project_in / project_out: the final norm is followed by a linear map to the unembedding
OPT_PROJECTED = Case(
    "opt_projected",
    "opt",
    _cfg(
        "OPTConfig",
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
    ),
    "",
    **OPT,
)


def _case(case_id: str) -> Case:
    return {c.id: c for c in (OPT_PROJECTED, GEMMA2_UNCAPPED)}.get(case_id) or BY_ID[case_id]


# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    return load_model(ModelSpec()).tokenizer


def test_embedded_head_dla_matches_hooked_forward(tmp_path):
    """SmolLM2-135M: head_dla equals the hook-based computation to 1e-4, and the sum identity holds."""
    from lmtrace.spec.run_spec import ModelSpec

    run = run_spec(tmp_path, _spec(ModelSpec().ref, n=3))
    ref = FullForward(ModelSpec().ref, BY_ID["llama"])
    _check_against_reference(run, ref, 1e-4)
    _sum_identity(run, 1e-4)


@pytest.mark.parametrize("case_id", ["llama", "gpt2", "phi", "opt_projected", "gpt_neox"])
def test_family_head_dla_and_sum_identity(case_id, tokenizer, tmp_path):
    """Tiny random models: RMSNorm (Llama), LayerNorm + Conv1D + biases (GPT-2), parallel attention +
    lm_head bias (Phi), a linear map after the final norm (OPT's project_out), GPT-NeoX."""
    case = _case(case_id)
    model_dir = build_tiny(case, tokenizer, tmp_path / "model")
    run = run_spec(tmp_path, _spec(str(model_dir)))
    _check_against_reference(run, FullForward(str(model_dir), case), 1e-4)
    _sum_identity(run, 1e-4)


@pytest.mark.parametrize("case_id", ["gemma2_uncapped", "gemma3", "olmo2"])
def test_post_normed_blocks_head_dla_and_sum_identity(case_id, tokenizer, tmp_path):
    """Gemma 2 / Gemma 3 / OLMo2 blocks normalise the attention and MLP outputs before the residual add
    (Gemma's RMSNorm: float32, 1 + weight; norm weights random here): with those norms' scales frozen,
    head_dla, attn_dla and mlp_dla equal the reference's, and the parts sum to the model's logits."""
    case = _case(case_id)
    model_dir = build_with_random_norms(case, tokenizer, tmp_path / "model")
    run = run_spec(tmp_path, _spec(str(model_dir)))
    _check_against_reference(run, FullForward(str(model_dir), case), 1e-4)
    _sum_identity(run, 1e-4)
    heads = run.array("head_dla")[:].sum(-1)  # no output-projection bias: the heads are the whole attention part
    np.testing.assert_allclose(heads, run.array("attn_dla")[:], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "case_id,fragment", [("gemma2", "final_logit_softcapping=30.0"), ("opt_postln", "do_layer_norm_before=false")]
)
def test_unsupported_family_is_refused_before_any_run_directory(case_id, fragment, tokenizer, tmp_path):
    """Final logit soft-capping (Gemma 2's default) is not linear in the residual stream, and post-LN blocks
    normalise the residual after every add: no exact attribution, so `capture.head_dla: true` is a spec
    error naming what is unsupported, raised before the run exists."""
    from lmtrace.exits.errors import SpecError

    model_dir = build_tiny(BY_ID[case_id], tokenizer, tmp_path / "model")
    with pytest.raises(SpecError, match="capture.head_dla") as err:
        run_spec(tmp_path, _spec(str(model_dir)))
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_output_norm_that_is_not_an_rmsnorm_is_refused_naming_it():
    """A block's output norm must be a scale of its input (an RMSNorm): a LayerNorm there (centring) is
    refused naming the layer and the module."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from lmtrace.capture.arch import adapter_for
    from lmtrace.capture.dla import unsupported_reason

    model = Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    assert unsupported_reason(adapter_for(model)) is None
    model.model.layers[1].post_feedforward_layernorm = torch.nn.LayerNorm(16)
    reason = unsupported_reason(adapter_for(model))
    assert "layer 1's post_feedforward_layernorm (LayerNorm) is not an RMSNorm" in reason and "\n" not in reason


def test_unsupported_family_cli_exit_2_one_line(tokenizer, tmp_path):
    import yaml

    from tests.helpers.cli import assert_one_line_error, lmtrace

    model_dir = build_tiny(BY_ID["gemma2"], tokenizer, tmp_path / "model")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(_spec(str(model_dir))))
    proc = lmtrace(tmp_path, "generate", "spec.yaml", "--quiet")
    assert_one_line_error(proc, 2, "capture.head_dla is not possible", "Gemma2ForCausalLM", "final_logit_softcapping")


def test_heads_ranks_by_dla_and_by_a_head_sweep(tiny_llama_dir, tmp_path):
    """`lmtrace heads`: `importance` is the mean |head_dla| (read here with zarr), `dla_rank` ranks by it;
    after `lmtrace sweep --over heads`, `sweep_effect` is the mean effect of the sweep's long table (read
    here with pandas) and `head_rank` follows |sweep_effect|."""
    import pandas as pd
    import zarr

    from lmtrace.archive.reader import Run
    from lmtrace.commands.heads import heads_command
    from lmtrace.commands.sweep import run_sweep
    from lmtrace.spec.sweep_spec import SweepSpec

    data = _spec(str(tiny_llama_dir), n=4)
    data["capture"] = {"head_dla": True}
    run = run_spec(tmp_path, data)
    before = heads_command(str(run.path), json_out=True)
    dla = np.abs(zarr.open_array(str(run.path / "tensors.zarr" / "head_dla"), mode="r")[:])  # [seq, step, L, H]
    expected = np.nanmean(dla.reshape(-1, *dla.shape[2:]), axis=0)
    got = {(h["layer"], h["q_head"]): h for h in before["heads"]}
    for (layer, head), h in got.items():
        assert h["importance"] == pytest.approx(expected[layer, head], rel=1e-5)
        assert h["sweep_effect"] is None and h["sweep_rank"] is None
    order = sorted(got, key=lambda k: -expected[k])
    assert [got[k]["dla_rank"] for k in order] == list(range(1, len(order) + 1))
    assert [got[k]["head_rank"] for k in order] == list(range(1, len(order) + 1))

    sweep = run_sweep(str(run.path), SweepSpec(over="heads", edit="zero", metrics=["logprob"], batch=16))
    after = heads_command(str(Run(run.path).path), json_out=True)
    assert after["sweep"]["metric"] == "logprob" and after["sweep"]["edit"] == "zero"
    long = pd.read_parquet(Path(sweep.path) / "sweep.parquet")
    effect = long[long.metric == "logprob"].groupby(["layer", "q_head"]).effect.mean()
    got = {(h["layer"], h["q_head"]): h for h in after["heads"]}
    for key, h in got.items():
        assert h["sweep_effect"] == pytest.approx(effect[key], abs=1e-6)
        assert h["dla_rank"] is not None
    order = sorted(got, key=lambda k: -abs(effect[k]))
    assert [got[k]["sweep_rank"] for k in order] == list(range(1, len(order) + 1))
    assert [got[k]["head_rank"] for k in order] == list(range(1, len(order) + 1))
    table = pd.read_parquet(run.path / "analysis" / "heads.parquet")
    assert {"importance", "dla_rank", "sweep_effect", "sweep_rank", "head_rank"} <= set(table.columns)


def test_layers_left_out_are_the_rest_term(tiny_llama_dir, tmp_path):
    """With `capture.layers` a subset, `rest_dla` is what the other layers wrote: the same steps of a run
    capturing every layer attribute exactly that to those layers; the identity still holds."""
    full = run_spec(tmp_path / "full", _spec(str(tiny_llama_dir)))
    data = _spec(str(tiny_llama_dir))
    data["capture"] = {**CAPTURE, "layers": [0, 2]}
    part = run_spec(tmp_path / "part", data)
    assert part.tokens().column("token_id").to_pylist() == full.tokens().column("token_id").to_pylist()
    for suffix in ("", "_logit"):
        left_out = full.array("attn_dla" + suffix)[:][..., [1, 3]].sum(-1) + full.array("mlp_dla" + suffix)[:][
            ..., [1, 3]
        ].sum(-1)
        np.testing.assert_allclose(part.array("rest_dla" + suffix)[:], left_out, atol=1e-4, rtol=0)
        np.testing.assert_allclose(
            part.array("head_dla" + suffix)[:], full.array("head_dla" + suffix)[:][:, :, [0, 2]], atol=1e-5, rtol=0
        )
    tok = part.tokens().to_pandas()
    gen = tok[~tok.is_prompt]
    total = (
        part.array("embed_dla")[:]
        + part.array("attn_dla")[:].sum(-1)
        + part.array("mlp_dla")[:].sum(-1)
        + part.array("bias_dla")[:]
        + part.array("rest_dla")[:]
    )
    for r in gen.itertuples():
        assert abs(total[r.sequence, int(r.step)] - r.margin) <= 1e-4 * max(1.0, abs(r.margin))


# ---- margin contributions (steps.parquet `margin_contrib`) ----------------------------------------
def _final_constant(ref: FullForward, a: int, b: int) -> float:
    """The part of logit(a) − logit(b) no residual part carries: the final LayerNorm's bias, the biases of
    the linear maps after it and the unembedding's bias."""
    mods = [m for m in (_get(ref.model, p) for p in ref.case.final) if m is not None]
    y = torch.zeros(ref.model.lm_head.in_features if not mods else mods[0].weight.shape[-1])
    if mods and not isinstance(mods[0], torch.nn.Linear):
        norm, mods = mods[0], mods[1:]
        if getattr(norm, "bias", None) is not None:
            y = norm.bias.float()
    for m in mods:
        y = y @ m.weight.float().T + (m.bias.float() if m.bias is not None else 0.0)
    head = ref.model.lm_head
    const = y @ (head.weight[a] - head.weight[b]).float()
    if head.bias is not None:
        const = const + head.bias[a] - head.bias[b]
    return float(const)


@torch.inference_mode()
def _check_margin_contributions(run, ref: FullForward, tol: float) -> int:
    """Every step: the archived per-layer margin_contrib equals the test's own share of each layer's change
    to the residual (through the final norm frozen at the final residual, on the run's final top-1 and
    top-2), and Σ layers + the embedding's share + the constant = the model's own top-1 − top-2 logit
    difference before any final soft-capping (= tokens.parquet `margin` without one). Returns steps checked."""
    steps = run.steps().to_pandas()
    cap = getattr(ref.model.config, "final_logit_softcapping", None)
    checked = 0
    for seq in range(run.shape["n_sequences"]):
        ids, gen = _greedy_steps(run, seq)
        out = ref.run(ids)
        prompt_len = len(ids) - len(gen)
        for row in gen.itertuples():
            pos = prompt_len + int(row.step) - 1
            a, b = int(row.alt_ids[0]), int(row.alt_ids[1])
            x = out["resid"][-1][pos]  # the final residual: the final norm's input
            before = [out["embed"][pos]] + [out["resid"][layer][pos] for layer in range(len(out["resid"]) - 1)]
            shares = [
                ref.margin_share(x, out["resid"][layer][pos] - before[layer], a, b)
                for layer in range(len(out["resid"]))
            ]
            got = steps[(steps.sequence == seq) & (steps.step == row.step)].sort_values("layer").margin_contrib
            for layer, (share, scale) in enumerate(shares):
                assert abs(got.iloc[layer] - share) <= tol * max(1.0, scale), ("margin_contrib", seq, row.step, layer)
            # the model's own final modules and unembedding on x: the logits before any soft-capping
            y = x
            for m in (_get(ref.model, p) for p in ref.case.final):
                y = y if m is None else m(y)
            z = ref.model.lm_head(y).float()
            logits = out["logits"][pos]
            torch.testing.assert_close(torch.tanh(z / cap) * cap if cap else z, logits, atol=1e-4, rtol=1e-5)
            pre_cap = float(z[a] - z[b])
            if not cap:
                assert abs(row.margin - pre_cap) <= tol * max(1.0, abs(pre_cap))
            embed_share = ref.margin_share(x, out["embed"][pos], a, b)[0]
            total = float(got.sum()) + embed_share + _final_constant(ref, a, b)
            assert abs(total - pre_cap) <= tol * max(1.0, abs(pre_cap)), ("sum", seq, row.step, total, pre_cap)
            checked += 1
    return checked


MARGIN_CAPTURE = {**CAPTURE, "head_dla": False, "margin_contributions": True}


@pytest.mark.parametrize("case_id", ["llama", "gpt2", "phi", "opt_postln", "gemma2"])
def test_margin_contributions_are_logits_that_sum_to_the_margin(case_id, tokenizer, tmp_path):
    """margin_contrib goes through the final norm frozen at its actual scale, so it is in logits: RMSNorm
    (Llama), LayerNorm with bias (GPT-2), lm_head bias (Phi), no final norm but project_out (post-LN OPT),
    and final soft-capping (Gemma 2: the sum is the margin before the cap)."""
    case = _case(case_id)
    model_dir = build_with_random_norms(case, tokenizer, tmp_path / "model")
    data = _spec(str(model_dir), n=4)
    data["capture"] = MARGIN_CAPTURE
    run = run_spec(tmp_path, data)
    assert _check_margin_contributions(run, FullForward(str(model_dir), case), 1e-4) == 8
