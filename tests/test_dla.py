"""Per-head direct logit attribution (`capture.head_dla`) against the test's own hook-based computation.

The reference is a plain transformers forward (eager attention, float32) over the final sequence,
with forward hooks placed from tests/test_architectures.py's own `Case` table: each head's output is
its slice of the output projection's input times its slice of the projection's weight, and the final
norm is frozen at the scale the final residual actually has (σ computed here from the norm module's
own weight / bias / eps). The sum identity is checked against the model's own logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_spec
from test_architectures import BY_ID, OPT, Case, FullForward, _cfg, _get, build_tiny

CAPTURE = {"attention": {"enabled": False}, "qkv": False, "ffn": {"enabled": False}, "lens": {"enabled": False},
           "component_norms": False, "margin_contributions": False, "head_dla": True}
PROMPTS = ["The quick brown fox", "One, two, three, four,"]


def _spec(model: str, n: int = 3) -> dict:
    return {"model": model, "prompts": PROMPTS, "capture": CAPTURE,
            "generation": {"max_new_tokens": n, "batch_size": 2, "temperature": 0.0}}


def _frozen_norm(norm: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The final norm as the linear map it is with its scale fixed at the actual residual x [d]: c [..., d]."""
    if isinstance(norm, torch.nn.LayerNorm):
        xc = x - x.mean()
        sigma = torch.sqrt((xc * xc).mean() + norm.eps)
        c = c - c.mean(-1, keepdim=True)
        return c / sigma * (norm.weight.float() if norm.weight is not None else 1.0)
    weight = norm.weight.float()
    if "Gemma" in type(norm).__name__:
        weight = 1.0 + weight
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return c / torch.sqrt((x * x).mean() + eps) * weight


class Attribution:
    """The test's own DLA of one final sequence, at every position, from a FullForward."""

    def __init__(self, ref: FullForward, ids: list[int]):
        self.ref, self.out = ref, ref.run(ids)
        model, case = ref.model, ref.case
        self.final = [m for m in (_get(model, p) for p in case.final) if m is not None]
        cfg = getattr(model.config, "text_config", None) or model.config
        self.H = cfg.num_attention_heads
        self.blocks = ref.blocks

    def _through_final(self, pos: int, parts: torch.Tensor) -> torch.Tensor:
        """parts [..., d] -> their (frozen-norm) images in the unembedding's input space."""
        y = _frozen_norm(self.final[0], self.out["resid"][-1][pos], parts)
        for m in self.final[1:]:  # linear maps (OPT's project_out); their bias is a constant term
            y = y @ m.weight.float().T
        return y

    def head_outputs(self, layer: int, pos: int) -> torch.Tensor:
        """[H, d]: each head's output written to the residual stream (its o_proj slice, no bias)."""
        o = _get(self.blocks[layer], self.ref.case.o_proj)
        z = self.out["o_in"][layer][pos]  # [H*D]
        D = z.shape[0] // self.H
        w = o.weight.float()
        w_o = w if isinstance(o, torch.nn.Linear) else w.T  # GPT-2's Conv1D stores [in, out]
        return torch.stack([w_o[:, h * D:(h + 1) * D] @ z[h * D:(h + 1) * D] for h in range(self.H)])

    def head_dla(self, pos: int, chosen: int, runner_up: int) -> np.ndarray:
        W = self.ref.model.lm_head.weight.float()
        direction = W[chosen] - W[runner_up]
        L = len(self.blocks)
        return np.stack([(self._through_final(pos, self.head_outputs(layer, pos)) @ direction).numpy()
                         for layer in range(L)])


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
            np.testing.assert_allclose(got, att.head_dla(pos, *top2), atol=atol, rtol=0,
                                       err_msg=f"head_dla sequence {seq} step {step}")


def _sum_identity(run, tol: float) -> None:
    """embedding + Σ attention + Σ MLP + constant + rest = the model's final logit difference (tokens.parquet
    `margin`, greedy) and final chosen logit (`alt_logits[0]`), per step; rest ≈ 0 with every layer captured."""
    tok = run.tokens().to_pandas()
    gen = tok[~tok.is_prompt]
    for suffix, target in (("", lambda r: r.margin), ("_logit", lambda r: r.alt_logits[0])):
        total = (run.array("embed_dla" + suffix)[:] + run.array("attn_dla" + suffix)[:].sum(-1)
                 + run.array("mlp_dla" + suffix)[:].sum(-1) + run.array("bias_dla" + suffix)[:]
                 + run.array("rest_dla" + suffix)[:])
        for r in gen.itertuples():
            expected = float(target(r))
            assert abs(total[r.sequence, int(r.step)] - expected) <= tol * max(1.0, abs(expected)), (suffix, r.sequence, r.step)
        rest = run.array("rest_dla" + suffix)[:]
        scale = np.abs(run.array("attn_dla" + suffix)[:]).max()
        assert np.nanmax(np.abs(rest)) <= 1e-4 * max(1.0, scale), "a part of the residual stream was not attributed"


# pre-LN OPT with project_in / project_out: the final norm is followed by a linear map to the unembedding
OPT_PROJECTED = Case("opt_projected", "opt", _cfg("OPTConfig", hidden_size=64, ffn_dim=128, num_hidden_layers=3,
                                                  num_attention_heads=4, word_embed_proj_dim=32,
                                                  max_position_embeddings=256), "", **OPT)


# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from lmtrace.models import load_model
    from lmtrace.spec import ModelSpec

    return load_model(ModelSpec()).tokenizer


def test_embedded_head_dla_matches_hooked_forward(tmp_path):
    """SmolLM2-135M: head_dla equals the hook-based computation to 1e-4, and the sum identity holds."""
    from lmtrace.spec import ModelSpec

    run = run_spec(tmp_path, _spec(ModelSpec().ref, n=3))
    ref = FullForward(ModelSpec().ref, BY_ID["llama"])
    _check_against_reference(run, ref, 1e-4)
    _sum_identity(run, 1e-4)


@pytest.mark.parametrize("case_id", ["llama", "gpt2", "phi", "opt_projected", "gpt_neox"])
def test_family_head_dla_and_sum_identity(case_id, tokenizer, tmp_path):
    """Tiny random models: RMSNorm (Llama), LayerNorm + Conv1D + biases (GPT-2), parallel attention +
    lm_head bias (Phi), a linear map after the final norm (OPT's project_out), GPT-NeoX."""
    case = OPT_PROJECTED if case_id == "opt_projected" else BY_ID[case_id]
    model_dir = build_tiny(case, tokenizer, tmp_path / "model")
    run = run_spec(tmp_path, _spec(str(model_dir)))
    _check_against_reference(run, FullForward(str(model_dir), case), 1e-4)
    _sum_identity(run, 1e-4)


@pytest.mark.parametrize("case_id,fragment", [("gemma2", "post_feedforward_layernorm"), ("olmo2", "post_feedforward_layernorm"),
                                              ("opt_postln", "do_layer_norm_before=false")])
def test_unsupported_family_is_refused_before_any_run_directory(case_id, fragment, tokenizer, tmp_path):
    """Blocks that normalise a head's output (or the residual) after the add: no exact attribution, so
    `capture.head_dla: true` is a spec error naming what is unsupported, raised before the run exists."""
    from lmtrace.errors import SpecError

    model_dir = build_tiny(BY_ID[case_id], tokenizer, tmp_path / "model")
    with pytest.raises(SpecError, match="capture.head_dla") as err:
        run_spec(tmp_path, _spec(str(model_dir)))
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_unsupported_family_cli_exit_2_one_line(tokenizer, tmp_path):
    import yaml
    from test_cli_errors import assert_one_line_error, lmtrace

    model_dir = build_tiny(BY_ID["gemma2"], tokenizer, tmp_path / "model")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(_spec(str(model_dir))))
    proc = lmtrace(tmp_path, "generate", "spec.yaml", "--quiet")
    assert_one_line_error(proc, 2, "capture.head_dla is not possible", "Gemma2ForCausalLM")


def test_heads_ranks_by_dla_and_by_a_head_sweep(tiny_llama_dir, tmp_path):
    """`lmtrace heads`: `importance` is the mean |head_dla| (read here with zarr), `dla_rank` ranks by it;
    after `lmtrace sweep --over heads`, `sweep_effect` is the mean effect of the sweep's long table (read
    here with pandas) and `rank` follows |sweep_effect|."""
    import pandas as pd
    import zarr

    from lmtrace.archive.reader import Run
    from lmtrace.commands.heads import heads_command
    from lmtrace.commands.sweep import run_sweep
    from lmtrace.sweep_spec import SweepSpec

    data = _spec(str(tiny_llama_dir), n=4)
    data["capture"] = {"head_dla": True}
    run = run_spec(tmp_path, data)
    before = heads_command(str(run.path), json_out=True)
    dla = np.abs(zarr.open_array(str(run.path / "tensors.zarr" / "head_dla"), mode="r")[:])  # [seq, step, L, H]
    expected = np.nanmean(dla.reshape(-1, *dla.shape[2:]), axis=0)
    got = {(h["layer"], h["head"]): h for h in before["heads"]}
    for (layer, head), h in got.items():
        assert h["importance"] == pytest.approx(expected[layer, head], rel=1e-5)
        assert h["sweep_effect"] is None and h["sweep_rank"] is None
    order = sorted(got, key=lambda k: -expected[k])
    assert [got[k]["dla_rank"] for k in order] == list(range(1, len(order) + 1))
    assert [got[k]["rank"] for k in order] == list(range(1, len(order) + 1))

    sweep = run_sweep(str(run.path), SweepSpec(over="heads", edit="zero", metrics=["logprob"], batch=16))
    after = heads_command(str(Run(run.path).path), json_out=True)
    assert after["sweep"]["metric"] == "logprob" and after["sweep"]["edit"] == "zero"
    long = pd.read_parquet(Path(sweep.path) / "sweep.parquet")
    effect = long[long.metric == "logprob"].groupby(["layer", "head"]).effect.mean()
    got = {(h["layer"], h["head"]): h for h in after["heads"]}
    for key, h in got.items():
        assert h["sweep_effect"] == pytest.approx(effect[key], abs=1e-6)
        assert h["dla_rank"] is not None
    order = sorted(got, key=lambda k: -abs(effect[k]))
    assert [got[k]["sweep_rank"] for k in order] == list(range(1, len(order) + 1))
    assert [got[k]["rank"] for k in order] == list(range(1, len(order) + 1))
    table = pd.read_parquet(run.path / "analysis" / "heads.parquet")
    assert {"importance", "dla_rank", "sweep_effect", "sweep_rank", "rank"} <= set(table.columns)


def test_layers_left_out_are_the_rest_term(tiny_llama_dir, tmp_path):
    """With `capture.layers` a subset, `rest_dla` is what the other layers wrote: the same steps of a run
    capturing every layer attribute exactly that to those layers; the identity still holds."""
    full = run_spec(tmp_path / "full", _spec(str(tiny_llama_dir)))
    data = _spec(str(tiny_llama_dir))
    data["capture"] = {**CAPTURE, "layers": [0, 2]}
    part = run_spec(tmp_path / "part", data)
    assert part.tokens().column("token_id").to_pylist() == full.tokens().column("token_id").to_pylist()
    for suffix in ("", "_logit"):
        left_out = (full.array("attn_dla" + suffix)[:][..., [1, 3]].sum(-1)
                    + full.array("mlp_dla" + suffix)[:][..., [1, 3]].sum(-1))
        np.testing.assert_allclose(part.array("rest_dla" + suffix)[:], left_out, atol=1e-4, rtol=0)
        np.testing.assert_allclose(part.array("head_dla" + suffix)[:], full.array("head_dla" + suffix)[:][:, :, [0, 2]],
                                   atol=1e-5, rtol=0)
    tok = part.tokens().to_pandas()
    gen = tok[~tok.is_prompt]
    total = (part.array("embed_dla")[:] + part.array("attn_dla")[:].sum(-1) + part.array("mlp_dla")[:].sum(-1)
             + part.array("bias_dla")[:] + part.array("rest_dla")[:])
    for r in gen.itertuples():
        assert abs(total[r.sequence, int(r.step)] - r.margin) <= 1e-4 * max(1.0, abs(r.margin))
