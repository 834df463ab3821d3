"""Every archived value matches the model's own full forward on the final sequence.

The run uses the KV-cached loop with sdpa and probes; the reference is one eager forward over
prompt + generated tokens with output_attentions / output_hidden_states. Tolerances are for float32,
except the logit lens in its bfloat16 mode (bfloat16 ranking, float32 re-scoring, normaliser partly
from bfloat16 logits; lmtrace/lens.py): ids and margins exact, probabilities within LENS_BF16_RTOL.
The logit lens checked here is the deferred one (the default): computed by `lmtrace lens` from the
archived residuals after generation (tests/analysis/test_deferred_lens.py: equal to the inline lens).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.reference import Reference, check_sequence
from tests.helpers.reference import sequence_ids as _ids
from tests.helpers.runs import PROMPTS, run_spec, with_lens


@pytest.fixture(scope="module")
def embedded_ref():
    return Reference("embedded:smollm2-135m")


def _spec(**gen):
    return {
        "prompts": PROMPTS,
        "generation": {"max_new_tokens": 10, "batch_size": 1, **gen},
        # the full preset: q/k/v, and float32 residuals, so that the lens is exact
        "capture": {"preset": "full", "residual": {"vectors_at": [0, 29]}},
        "output": {"float_dtype": "float32"},
    }


def test_single_prompt_greedy_matches_full_forward(tmp_path, embedded_ref):
    spec = _spec()
    spec["prompts"] = PROMPTS[:1]
    run = with_lens(run_spec(tmp_path, spec))
    assert run.status == "complete"
    assert run.manifest["lens"]["dtype"] == "float32"  # the default: exact
    assert check_sequence(run, embedded_ref, 0) == 10


def test_default_capture_lens_from_float16_residuals_is_within_its_documented_bound(tmp_path, embedded_ref):
    """The standard preset (the default) stores residuals in float16 and no q/k/v: the deferred lens
    from them is within RESID16_PROB_ATOL of the float32 reference, everything else as exact as ever."""
    spec = _spec()
    spec["prompts"] = PROMPTS[2:3]
    spec["capture"] = {}
    run = with_lens(run_spec(tmp_path, spec))
    assert run.manifest["spec_resolved"]["capture"]["preset"] == "standard"
    assert run.manifest["arrays"]["resid"]["dtype"] == "float16" and "q" not in run.array_names()
    assert check_sequence(run, embedded_ref, 0) == 10


def test_bfloat16_lens_has_exact_ids_and_probabilities_within_its_bound(tmp_path, embedded_ref):
    spec = _spec()
    spec["prompts"] = PROMPTS[1:2]
    spec["capture"]["lens"] = {"dtype": "bfloat16"}
    run = with_lens(run_spec(tmp_path, spec))
    assert run.manifest["lens"]["dtype"] == "bfloat16"
    assert check_sequence(run, embedded_ref, 0) == 10


def test_padded_batch_sampled_matches_full_forward_and_single_runs(tmp_path, embedded_ref):
    gen = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}
    batched = with_lens(
        run_spec(tmp_path / "b", {**_spec(**gen), "generation": {**_spec(**gen)["generation"], "batch_size": 3}})
    )
    single = run_spec(tmp_path / "s", _spec(**gen))
    assert len(set(batched.prompt_len().tolist())) > 1, "prompts must have different lengths to test padding"
    for seq in range(len(PROMPTS)):
        check_sequence(batched, embedded_ref, seq)
        assert _ids(batched, seq)[0] == _ids(single, seq)[0]
    a, b = batched.array("attn")[:], single.array("attn")[:]
    np.testing.assert_allclose(a, b, atol=1e-5, equal_nan=True)
    np.testing.assert_allclose(
        batched.array("resid")[:], single.array("resid")[:], rtol=1e-4, atol=1e-3, equal_nan=True
    )


def test_archived_q_and_k_reproduce_the_attention_rows(tmp_path):
    """Post-rotary q of the query position against archived prompt K and per-step K gives the rows."""
    run = run_spec(tmp_path, {**_spec(), "prompts": PROMPTS[1:2]})
    P, n = int(run.prompt_len()[0]), int(run.generated_len()[0])
    q, k = run.array("q")[0], run.array("k")[0]
    prompt_k = run.array("prompt_k")[0]
    attn = run.array("attn")[0]
    kv_of = run.tensors["kv_head_of_head"][:]
    head_dim = q.shape[-1]
    for s in (0, n - 1):
        for li in (0, 15, 29):
            # keys: prompt positions, then the key of each earlier step's query position
            keys = np.concatenate([prompt_k[li, :, :P], k[1 : s + 1, li].transpose(1, 0, 2)], axis=1)  # [kv, T, D]
            scores = np.einsum("hd,htd->ht", q[s, li], keys[kv_of]) / np.sqrt(head_dim)
            probs = torch.tensor(scores).softmax(-1).numpy()
            np.testing.assert_allclose(probs, attn[s, li, :, : P + s], atol=1e-4)


def test_same_spec_and_seed_is_bit_identical(tmp_path):
    spec = {**_spec(temperature=1.0, seed=3), "prompts": PROMPTS[:2]}
    spec["generation"]["batch_size"] = 2
    a = run_spec(tmp_path / "a", spec)
    b = run_spec(tmp_path / "b", spec)
    ta, tb = a.tokens().to_pandas(), b.tokens().to_pandas()
    assert ta.token_id.tolist() == tb.token_id.tolist()
    for name in a.array_names():
        x, y = a.tensors[name][...], b.tensors[name][...]
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_float16_storage_is_within_half_precision(tmp_path, embedded_ref):
    spec = {**_spec(), "prompts": PROMPTS[:1], "output": {"float_dtype": "float16"}}
    run = run_spec(tmp_path, spec)
    assert run.array("attn").dtype == np.float16
    ids, _ = _ids(run, 0)
    r = embedded_ref.forward(ids)
    P = int(run.prompt_len()[0])
    expected = r["attn"][10][:, P - 1 + 3, : P + 3].numpy()
    np.testing.assert_allclose(run.array("attn")[0, 3, 10, :, : P + 3].astype(np.float32), expected, atol=1e-3)
