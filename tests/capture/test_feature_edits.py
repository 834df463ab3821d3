"""Feature edits in `intervene` (ablate_feature, clamp_feature, steer_feature; docs/interventions.md): each
equals the test's own hook that encodes and decodes with the SAE's weights and keeps the reconstruction
error; an edit that changes nothing reproduces the parent bit for bit; bad requests are one line, exit 2,
and leave no child behind."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from lmtrace.archive.reader import Run
from lmtrace.commands.intervene import run_intervene
from lmtrace.exits.errors import SpecError
from lmtrace.runner.models import load_model
from lmtrace.spec.run_spec import ModelSpec
from tests.helpers.cli import assert_one_line_error, lmtrace, write
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import random_sae, write_saelens_dir

HOOK = "blocks.1.hook_resid_post"
D_SAE = 32
DEAD = 5  # a latent whose encoder bias keeps it at 0 on every token


@pytest.fixture(scope="module")
def sae(tmp_path_factory):
    """(directory, weights) of a standard SAE at layer 1's residual output, latent DEAD never active."""
    path = tmp_path_factory.mktemp("saes") / "l1-resid"
    cfg, w = random_sae(path, HOOK, 64, D_SAE, seed=3, scale=3.0)
    w["b_enc"][DEAD] = -1e4
    write_saelens_dir(path, cfg, w)
    return path, w


@pytest.fixture(scope="module")
def parent(tmp_path_factory, sharp_llama_dir, sae):
    """A sampled run of the sharp tiny Llama that archives the SAE's features (recorded as `l1-resid`)."""
    return run_spec(
        tmp_path_factory.mktemp("parent"),
        {
            "model": str(sharp_llama_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 6, "batch_size": 3, "temperature": 0.9, "seed": 4},
            "output": {"float_dtype": "float32"},
            "capture": {
                "residual": {"vectors_at": [1], "dtype": "float32"},
                "features": [{"sae": str(sae[0]), "top_k": 4}],
            },
        },
    )


def _child(parent, entries, **kw):
    result, effects = run_intervene(str(parent.path), entries, **kw)
    return Run(result.run_dir), effects.to_pandas()


def _own_edit(w: dict, kind: str, feature: int, value: float):
    """x -> x' = x + decode(f') - decode(f), f = ReLU((x - b_dec) W_enc + b_enc) (steer: x + C W_dec[F]),
    written from the SAE's weights, not with lmtrace's SAE."""
    W_enc, b_enc, W_dec, b_dec = (torch.from_numpy(w[n]).double() for n in ("W_enc", "b_enc", "W_dec", "b_dec"))

    def edit(x):
        xd = x.double()
        if kind == "steer":
            return (xd + value * W_dec[feature]).to(x.dtype)
        f = torch.relu((xd - b_dec) @ W_enc + b_enc)
        g = f.clone()
        g[..., feature] = 0.0 if kind == "ablate" else value
        return (xd + (g @ W_dec + b_dec) - (f @ W_dec + b_dec)).to(x.dtype)

    return edit


def _reference(model, ids, edit, first_pos):
    """The test's own full forward over `ids`, `edit` applied to layer 1's output at positions >= first_pos:
    (log-probs [T, vocab], layer 1's edited output [T, d])."""
    kept = {}

    def hook(module, args, out):
        x = out[0] if isinstance(out, tuple) else out
        y = x.clone()
        y[:, first_pos:] = edit(x[:, first_pos:])
        kept["resid"] = y[0]
        return (y, *out[1:]) if isinstance(out, tuple) else y

    handle = model.model.layers[1].register_forward_hook(hook)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    handle.remove()
    return logits.float().log_softmax(-1), kept["resid"]


def _sequence_ids(run, seq):
    t = run.tokens().to_pandas()
    return t[t.sequence == seq].sort_values("position").token_id.tolist()


def _most_active(parent) -> int:
    ids = parent.array("feat_l1-resid_idx")[:]
    ids = ids[ids >= 0]
    return int(np.bincount(ids, minlength=D_SAE).argmax())


@pytest.mark.parametrize("kind, value, from_step", [("ablate", 0.0, None), ("clamp", 6.0, 2), ("steer", 4.0, 1)])
def test_feature_edits_equal_the_tests_own_hook_with_the_error_kept(
    parent, sae, sharp_llama_dir, kind, value, from_step
):
    path, w = sae
    feature = _most_active(parent)
    entry = {"kind": f"{kind}_feature", "sae": str(path), "feature": feature}
    if kind != "ablate":
        entry["value" if kind == "clamp" else "coefficient"] = value
    child, effects = _child(parent, [entry], from_step=from_step)
    assert effects.logprob_shift.abs().max() > 1e-3  # the edit really changes the model
    edit = _own_edit(w, kind, feature, value)
    ri = parent.shape["resid_layers"].index(1)
    resid_child, resid_parent = child.array("resid")[:, :, ri], parent.array("resid")[:, :, ri]
    model = load_model(ModelSpec(ref=str(sharp_llama_dir), attn_implementation="eager")).model
    for seq in range(3):
        ids = _sequence_ids(parent, seq)
        P = int(parent.prompt_len()[seq])
        first_pos = 0 if not from_step else P - 1 + from_step  # the query position of step from_step
        ref, resid = _reference(model, ids, edit, first_pos)
        for _, row in effects[effects.sequence == seq].sort_values("step").iterrows():
            pos = P - 1 + row.step
            assert abs(row.child_logprob_of_parent_token - ref[pos, row.parent_token].item()) < 1e-4, (seq, row.step)
            np.testing.assert_allclose(resid_child[seq, row.step], resid[pos].numpy(), rtol=2e-5, atol=1e-4)
            if from_step and row.step < from_step:  # before the edit: the parent's residual, exactly
                np.testing.assert_array_equal(resid_child[seq, row.step], resid_parent[seq, row.step])


def test_the_child_records_the_edit_with_the_saes_path_and_checksum_and_compare_and_serve_name_it(parent, sae):
    from lmtrace.analysis.compare import compare_runs
    from lmtrace.serve.child_view import edits

    path, _ = sae
    child, _ = _child(parent, [{"kind": "clamp_feature", "sae": "l1-resid", "feature": 3, "value": 2.5}], from_step=1)
    (entry,) = child.manifest["interventions"]
    sha = hashlib.sha256((path / "sae_weights.safetensors").read_bytes()).hexdigest()
    assert entry["sae"] == str(path.resolve()) and entry["sae_sha256"] == sha
    assert (entry["kind"], entry["feature"], entry["value"], entry["steps"]) == ("clamp_feature", 3, 2.5, {"from": 1})
    label = f"feature-clamp l1-resid@{sha[:8]}:3=2.5"
    assert edits(child)["label"] == f"{label} from 1 (rescore)"
    differences = {d["key"]: d for d in compare_runs(parent, child).spec_differences}
    assert differences["interventions"]["b"] == f"{label} from 1"


def test_an_edit_that_changes_nothing_reproduces_the_parent_bit_for_bit(parent, sae):
    path, _ = sae
    nothing = [
        {"kind": "ablate_feature", "sae": str(path), "feature": DEAD},
        {"kind": "clamp_feature", "sae": str(path), "feature": DEAD, "value": 0.0},
        {"kind": "steer_feature", "sae": str(path), "feature": 7, "coefficient": 0.0},
    ]
    child, effects = _child(parent, nothing)
    assert child.tokens().to_pandas().token_id.tolist() == parent.tokens().to_pandas().token_id.tolist()
    names = parent.array_names()
    assert {"resid", "feat_l1-resid_val", "attn"} <= set(names)
    for name in names:
        np.testing.assert_array_equal(child.array(name)[:], parent.array(name)[:], err_msg=name)
    assert (effects.logprob_shift == 0).all() and (effects.kl_parent_child_topk == 0).all()


def test_regenerating_under_a_large_steer_changes_the_tokens_after_the_edited_step(parent, sae):
    path, _ = sae
    steer = [{"kind": "steer_feature", "sae": str(path), "feature": 7, "coefficient": 60.0}]
    child, _ = _child(parent, steer, mode="regenerate", from_step=2)
    p, c = parent.tokens().to_pandas(), child.tokens().to_pandas()
    changed = 0
    for seq in range(3):
        a = p[(p.sequence == seq) & ~p.is_prompt].sort_values("step").token_id.tolist()
        b = c[(c.sequence == seq) & ~c.is_prompt].sort_values("step").token_id.tolist()
        assert a[:2] == b[:2]  # replayed up to the first edited step
        changed += a[2:] != b[2:]
    assert changed >= 2


def test_a_yaml_edits_file_takes_the_feature_kinds(parent, sae, tmp_path):
    path, _ = sae
    spec = write(
        tmp_path / "edits.yaml",
        f"from_step: 1\ninterventions:\n  - {{kind: ablate_feature, sae: {path}, feature: {DEAD}}}\n",
    )
    proc = lmtrace(tmp_path, "intervene", str(parent.path), "--spec", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stderr
    child = Run(parent.path.parent / proc.stdout.strip())
    assert [e["kind"] for e in child.manifest["interventions"]] == ["ablate_feature"]
    np.testing.assert_array_equal(child.array("resid")[:], parent.array("resid")[:])


def _sae_at(tmp_path, name, hook, d_in):
    cfg, w = random_sae(tmp_path / name, hook, d_in, 8, seed=1)
    return tmp_path / name


def test_bad_feature_edits_are_one_line_and_leave_no_child(parent, sae, tmp_path):
    path, _ = sae
    before = sorted(p.name for p in parent.path.parent.iterdir())
    cases = [
        ({"kind": "ablate_feature", "sae": "nosuch", "feature": 1}, "unknown SAE 'nosuch'"),
        ({"kind": "ablate_feature", "sae": str(path), "feature": D_SAE}, f"feature {D_SAE} is out of range"),
        ({"kind": "ablate_feature", "sae": str(_sae_at(tmp_path, "narrow", HOOK, 32)), "feature": 1}, "d_in 32"),
        (
            {
                "kind": "ablate_feature",
                "sae": str(_sae_at(tmp_path, "deep", "blocks.9.hook_resid_post", 64)),
                "feature": 1,
            },
            "layers 0..3",
        ),
        (
            {
                "kind": "ablate_feature",
                "sae": str(_sae_at(tmp_path, "mid", "blocks.1.hook_resid_mid", 64)),
                "feature": 1,
            },
            "not supported",
        ),
        ({"kind": "clamp_feature", "sae": str(path), "feature": 1, "value": float("nan")}, "finite"),
        ({"kind": "ablate_feature", "sae": str(path), "feature": 1, "sae_sha256": "0" * 64}, "differ from those"),
    ]
    for entry, fragment in cases:
        with pytest.raises(SpecError, match=fragment):
            run_intervene(str(parent.path), [entry])
    assert sorted(p.name for p in parent.path.parent.iterdir()) == before
    for flag, text, fragment in [
        ("--feature-clamp", f"{path}:3", "write it as SAE:F=V"),
        ("--feature-steer", f"{path}:x*2", "'x' is not a feature id"),
        ("--feature-ablate", "nosuch:3", "unknown SAE 'nosuch'"),
    ]:
        proc = lmtrace(tmp_path, "intervene", str(parent.path), flag, text)
        assert_one_line_error(proc, 2, fragment)
    assert sorted(p.name for p in parent.path.parent.iterdir()) == before


def test_explain_replays_a_feature_edit_childs_edits(parent, sae):
    """explain rebuilds a child's forward with its recorded edits: the replayed log-prob of each explained
    step equals the one the child archived."""
    from lmtrace.commands.explain import explain_run

    path, _ = sae
    clamp = [{"kind": "clamp_feature", "sae": str(path), "feature": _most_active(parent), "value": 6.0}]
    child, effects = _child(parent, clamp, from_step=2)
    assert effects.logprob_shift.abs().max() > 1e-3
    result = explain_run(child.path, "1,3", sequence=1, methods=["grad_x_input"])
    for e in result.explanations:
        assert e.info["recomputed_logprob"] == pytest.approx(e.info["archived_logprob"], abs=1e-4), e.step
    assert result.entries[0]["model"]["interventions_replayed"][0]["kind"] == "clamp_feature"


def test_a_feature_edit_at_an_input_site_equals_the_tests_own_pre_hook(parent, sharp_llama_dir, tmp_path):
    """An SAE read at a module's input (resid_pre: the input of block 2) is edited there."""
    cfg, w = random_sae(tmp_path / "l2-pre", "blocks.2.hook_resid_pre", 64, 16, seed=5, scale=3.0)
    child, effects = _child(
        parent, [{"kind": "clamp_feature", "sae": str(tmp_path / "l2-pre"), "feature": 4, "value": 5.0}]
    )
    assert effects.logprob_shift.abs().max() > 1e-3
    edit = _own_edit(w, "clamp", 4, 5.0)
    model = load_model(ModelSpec(ref=str(sharp_llama_dir), attn_implementation="eager")).model

    def pre(module, args, kwargs):
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}

    handle = model.model.layers[2].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for seq in range(3):
            ids = _sequence_ids(parent, seq)
            P = int(parent.prompt_len()[seq])
            with torch.inference_mode():
                ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            for _, row in effects[effects.sequence == seq].iterrows():
                assert abs(row.child_logprob_of_parent_token - ref[P - 1 + row.step, row.parent_token].item()) < 1e-4
    finally:
        handle.remove()


def test_feature_edits_of_same_named_sae_directories_are_labelled_apart_by_their_weights_sha256():
    """`compare`, `ls` and serve name a feature edit's SAE by directory name @ 8 hex of its weights' sha256:
    two SAEs in directories named alike (or one directory retrained) never read alike."""
    from lmtrace.archive.summary import edit_label, edits_label

    a, b = hashlib.sha256(b"weights a").hexdigest(), hashlib.sha256(b"weights b").hexdigest()
    one = {"kind": "steer_feature", "sae": "/x/a/l6", "sae_sha256": a, "feature": 3, "coefficient": 4.0}
    two = {**one, "sae": "/x/b/l6/", "sae_sha256": b}
    assert edit_label(one) == f"feature-steer l6@{a[:8]}:3*4.0"
    assert edit_label(two) == f"feature-steer l6@{b[:8]}:3*4.0"
    both = edits_label({"kind": "intervene", "interventions": [one, {**two, "kind": "ablate_feature"}]})
    assert f"l6@{a[:8]}:3*4.0" in both and f"feature-ablate l6@{b[:8]}:3" in both
    assert edit_label({k: v for k, v in one.items() if k != "sae_sha256"}) == "feature-steer l6:3*4.0"


def test_a_killed_feature_steer_child_resumes_to_the_archive_of_an_uninterrupted_child(tmp_path, sharp_llama_dir, sae):
    """SIGKILL an `intervene --feature-steer` child (regenerating, the parent's features archived too) after
    its third committed block, `generate --resume` it: its tables, every array byte for byte and its
    effects equal those of the same child written without interruption; verify passes."""
    import pandas as pd

    from tests.helpers.archives import assert_same_archive

    parent = run_spec(
        tmp_path,
        {
            "model": str(sharp_llama_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 8, "batch_size": 2, "temperature": 0.9, "seed": 4},
            "output": {"float_dtype": "float32", "chunk_steps": 2, "run_id": "parent"},
            "capture": {"features": [{"sae": str(sae[0]), "top_k": 4}]},
        },
    )
    edit = ("--feature-steer", "l1-resid:3*6.0", "--mode", "regenerate", "--from-step", "2")
    killed = lmtrace(
        tmp_path,
        "intervene",
        str(parent.path),
        *edit,
        "--run-id",
        "kid",
        env={"LMTRACE_TEST_KILL_AT": "block-committed@3"},
    )
    assert killed.returncode != 0
    assert json.loads((tmp_path / "runs" / "kid" / "manifest.json").read_text())["status"] != "complete"
    resumed = lmtrace(tmp_path, "generate", "--resume", "kid")
    assert resumed.returncode == 0, resumed.stderr
    log = [json.loads(line) for line in (tmp_path / "runs" / "kid" / "log.jsonl").read_text().splitlines()]
    assert [e["from_step"] for e in log if e["event"] == "resume_batch"] == [6]  # batch 0 continued, not redone
    ref = lmtrace(tmp_path, "intervene", str(parent.path), *edit, "--run-id", "ref")
    assert ref.returncode == 0, ref.stderr
    kid, uninterrupted = Run(tmp_path / "runs" / "kid"), Run(tmp_path / "runs" / "ref")
    assert kid.status == "complete" and kid.manifest["interventions"] == uninterrupted.manifest["interventions"]
    assert "feat_l1-resid_idx" in kid.array_names()
    assert_same_archive(uninterrupted, kid)
    pd.testing.assert_frame_equal(
        pd.read_parquet(kid.path / "effects.parquet"),
        pd.read_parquet(uninterrupted.path / "effects.parquet"),
        check_exact=True,
    )
    assert (
        not kid.tokens().to_pandas().token_id.equals(parent.tokens().to_pandas().token_id)
    )  # the edit changed the text
    assert lmtrace(tmp_path, "verify", "kid").returncode == 0
