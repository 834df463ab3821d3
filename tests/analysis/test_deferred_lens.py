"""The deferred logit lens (`capture.lens.when: deferred`, the default) and `lmtrace lens`.

References, never lmtrace/deferred_lens.py itself: an inline run of the same spec (the lens computed
during generation by the tracer), the model's own full forward (tests/helpers/reference.py), and the archive
files read with pyarrow / zarr / xarray directly.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import zarr
from typer.testing import CliRunner

from lmtrace.analysis.compare import compare_runs
from lmtrace.archive.reader import IncompleteRunWarning, Run, lens_state
from lmtrace.cli.main import app
from lmtrace.commands.lens import compute_lens
from lmtrace.exits.errors import ArchiveError
from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.reference import Reference
from tests.helpers.runs import PROMPTS, run_spec

LAYERS = [0, 2, 3]  # captured layers (of 4); the residual vector is also asked for at layer 1, not captured:
VECTORS_AT = [1]  # so `resid` holds layers 0..3 and the lens reads rows 0, 2, 3 of it
N = 7  # new tokens; chunk_steps 3: blocks of 3, 3 and a partial 1
LENS_COLUMNS = [
    "lens_top1",
    "lens_top1_prob",
    "lens_margin",
    "lens_target_rank",
    "lens_target_prob",
    "lens_runner_up_rank",
    "lens_runner_up_prob",
    "settle_layer",
]


def _spec(model_dir, *, lens: dict | None = None, **gen) -> dict:
    return {
        "model": str(model_dir),
        "prompts": PROMPTS,
        "generation": {"max_new_tokens": N, "batch_size": 3, "temperature": 0.9, "seed": 5, **gen},
        # float32 residuals (the full preset's): the deferred lens then equals the inline one bit for bit
        "capture": {"layers": LAYERS, "residual": {"vectors_at": VECTORS_AT, "dtype": "float32"}, "lens": lens or {}},
        "output": {"float_dtype": "float32", "chunk_steps": 3},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_dir):
    """`base`: a deferred run, never computed here (tests copy it). For each lens dtype, a deferred and
    an inline run of one spec whose eos ends sequence 0 early (steps past its end are padding)."""
    root = tmp_path_factory.mktemp("deferred")
    base = run_spec(root / "base", _spec(tiny_llama_dir))
    t = base.tokens().to_pandas()
    gen0 = t[(t.sequence == 0) & ~t.is_prompt].sort_values("step").token_id.tolist()
    out = {"base": base, "root": root}
    for dtype in ("float32", "bfloat16"):
        for when in ("deferred", "inline"):
            out[dtype, when] = run_spec(
                root / f"{dtype}-{when}",
                _spec(tiny_llama_dir, lens={"dtype": dtype, "when": when}, eos_token_id=gen0[2]),
            )
    return out


def _copy(run: Run, dst: Path) -> Run:
    dst.mkdir(parents=True, exist_ok=True)
    return Run(shutil.copytree(run.path, dst / run.path.name))


def _steps(run: Run) -> pd.DataFrame:
    return (
        pq.read_table(run.path / "steps.parquet")
        .to_pandas()
        .sort_values(["sequence", "step", "layer"], ignore_index=True)
    )


# ---- a. after `lmtrace lens`, a deferred run equals an inline run of the same spec ------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deferred_lens_equals_the_inline_lens_bit_for_bit(runs, dtype, tmp_path):
    inline = runs[dtype, "inline"]
    deferred = _copy(runs[dtype, "deferred"], tmp_path)
    # the two runs generated the same tokens; one sequence stopped early, and blocks are partial
    assert deferred.tokens().to_pandas().equals(inline.tokens().to_pandas())
    gen_len = inline.generated_len()
    assert gen_len.min() < N and gen_len.max() == N, gen_len
    assert inline.manifest["lens"] == {
        **inline.manifest["lens"],
        "when": "inline",
        "dtype": dtype,
        "computed": {"by": "lmtrace generate"},
    }
    assert inline.manifest["shape"]["resid_layers"] == VECTORS_AT  # inline: no extra residual vectors
    assert deferred.manifest["shape"]["resid_layers"] == sorted(set(LAYERS) | set(VECTORS_AT))

    summary = compute_lens(deferred)
    assert summary["computed"] is True and summary["rows"] == int(gen_len.sum()) * len(LAYERS)
    run = Run(deferred.path)
    computed = run.manifest["lens"]["computed"]
    assert lens_state(run.manifest) == "ready" and computed["by"] == "lmtrace lens"
    assert computed["rows"] == summary["rows"] and computed["device"] == "cpu" and computed["seconds"] >= 0
    assert computed["at"] and 0 <= computed["model_load_s"] <= computed["seconds"]

    for name in ("lens_ids", "lens_probs"):
        got, want = run.array(name), inline.array(name)
        assert (got.shape, got.dtype, got.chunks) == (want.shape, want.dtype, want.chunks), name
        assert got.metadata.dimension_names == want.metadata.dimension_names == ("sequence", "step", "layer", "k_lens")
        assert got.compressors == want.compressors
        np.testing.assert_array_equal(got[:], want[:], err_msg=name)  # NaN padding equal too
        assert run.manifest["arrays"][name] == inline.manifest["arrays"][name]
    ids, probs = run.array("lens_ids")[:], run.array("lens_probs")[:]
    for seq, n in enumerate(gen_len):  # real steps filled, steps past the end are fill values
        assert (ids[seq, :n] >= 0).all() and not np.isnan(probs[seq, :n]).any()
        assert (ids[seq, n:] == -1).all() and np.isnan(probs[seq, n:]).all()

    # steps.parquet: the same columns in the same order, the same values, read without lmtrace
    got, want = _steps(run), _steps(inline)
    assert list(got.columns) == list(want.columns) and set(LENS_COLUMNS) <= set(got.columns)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    li = got.layer.map(LAYERS.index).to_numpy()
    assert (got.lens_top1.to_numpy() == ids[got.sequence.to_numpy(), got.step.to_numpy(), li, 0]).all()

    # every other array is the same as the inline run's; `resid` at the asked-for layer too
    assert set(run.array_names()) == set(inline.array_names())
    for name in set(run.array_names()) - {"resid", "resid_layer", "lens_ids", "lens_probs"}:
        np.testing.assert_array_equal(run.tensors[name][...], inline.tensors[name][...], err_msg=name)
    at = run.manifest["shape"]["resid_layers"].index(VECTORS_AT[0])
    np.testing.assert_array_equal(run.array("resid")[:, :, at], inline.array("resid")[:, :, 0])

    # readable without lmtrace: the consolidated metadata lists the new arrays
    import xarray as xr

    ds = xr.open_zarr(run.path / "tensors.zarr")
    assert ds["lens_ids"].dims == ("sequence", "step", "layer", "k_lens")
    np.testing.assert_array_equal(ds["lens_probs"].values, inline.array("lens_probs")[:])

    # a second call is a no-op
    assert compute_lens(Run(run.path))["computed"] is False
    np.testing.assert_array_equal(Run(run.path).array("lens_probs")[:], probs)


# ---- b. before `lmtrace lens` ---------------------------------------------------------------------
def test_a_pending_lens_is_absent_and_the_residual_covers_every_captured_layer(runs, tiny_llama_dir):
    run = Run(runs["base"].path)
    lens = run.manifest["lens"]
    assert lens_state(run.manifest) == "pending"
    assert lens["when"] == "deferred" and lens["dtype"] == "float32" and lens["computed"] is None
    assert "resid" in lens["input"]
    assert run.manifest["spec_resolved"]["capture"]["lens"]["when"] == "deferred"  # the default

    names = set(run.array_names())
    assert {"lens_ids", "lens_probs"}.isdisjoint(names) and {"lens_ids", "lens_probs"}.isdisjoint(
        run.manifest["arrays"]
    )
    assert {"lens_ids", "lens_probs"}.isdisjoint(zarr.open_group(str(run.path / "tensors.zarr"), mode="r").array_keys())
    for name in ("lens_ids", "lens_probs"):
        with pytest.raises(ArchiveError, match=rf"deferred and not computed yet: run `lmtrace lens {run.id}`"):
            run.array(name)
    with pytest.raises(ArchiveError, match="no array 'nope'"):  # other missing arrays: the usual message
        run.array("nope")

    # steps.parquet has no lens column (read without lmtrace); the other per-layer columns are there
    columns = pq.read_schema(run.path / "steps.parquet").names
    assert not set(LENS_COLUMNS) & set(columns)
    assert {"resid_norm", "delta_norm", "margin_contrib"} <= set(columns)

    # `resid` holds the residual after every captured layer and the asked-for one, equal to the
    # model's own forward (hidden states, the last one before the final norm)
    expected_layers = sorted(set(LAYERS) | set(VECTORS_AT))
    assert run.manifest["shape"]["resid_layers"] == expected_layers
    assert run.tensors["resid_layer"][:].tolist() == expected_layers
    resid = run.array("resid")[:]
    assert resid.dtype == np.float32 and resid.shape[2] == len(expected_layers)
    ref = Reference(str(tiny_llama_dir))
    t = run.tokens().to_pandas()
    for seq in range(len(PROMPTS)):
        ids = t[t.sequence == seq].sort_values("position").token_id.tolist()
        P, n = int(run.prompt_len()[seq]), int(run.generated_len()[seq])
        r = ref.forward(ids)
        for j, layer in enumerate(expected_layers):
            want = r["resid"][layer][P - 1 : P - 1 + n].numpy()
            np.testing.assert_allclose(resid[seq, :n, j], want, atol=1e-4, rtol=1e-4, err_msg=f"layer {layer}")
        assert np.isnan(resid[seq, n:]).all()


def test_inline_and_disabled_lenses_add_no_residual_vectors(tmp_path, tiny_llama_dir):
    states = {}
    for name, lens in (("inline", {"when": "inline"}), ("off", {"enabled": False})):
        spec = _spec(tiny_llama_dir, lens=lens, max_new_tokens=2)
        spec["capture"]["residual"] = {"vectors_at": []}
        run = run_spec(tmp_path / name, spec)
        assert run.manifest["shape"]["resid_layers"] == [] and "resid" not in run.array_names(), name
        states[name] = lens_state(run.manifest)
    assert states == {"inline": "ready", "off": "none"} and run.manifest["lens"] is None


def test_compute_lens_refuses_incomplete_runs_and_runs_without_a_lens(runs, tmp_path, tiny_llama_dir):
    cut = _copy(runs["base"], tmp_path / "cut")
    manifest = json.loads((cut.path / "manifest.json").read_text())
    (cut.path / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        with pytest.raises(ArchiveError, match="is interrupted.*complete runs"):
            compute_lens(Run(cut.path))
    assert lens_state(json.loads((cut.path / "manifest.json").read_text())) == "pending"
    assert "lens_ids" not in zarr.open_group(str(cut.path / "tensors.zarr"), mode="r").array_keys()

    spec = _spec(tiny_llama_dir, max_new_tokens=2)
    for capture in ("none", {**spec["capture"], "lens": {"enabled": False}}):
        run = run_spec(tmp_path / ("none" if capture == "none" else "off"), {**spec, "capture": capture})
        with pytest.raises(ArchiveError, match=f"run {run.id} captured no logit lens"):
            compute_lens(run)


def test_a_rerun_after_an_interrupted_lens_recomputes_all_of_it(runs, tmp_path):
    done = _copy(runs["float32", "deferred"], tmp_path / "done")
    compute_lens(done)
    done = Run(done.path)
    # what a kill after the arrays and steps.parquet were written, but before the manifest, leaves,
    # with every block of real steps and the lens columns wrong: the manifest says pending, so
    # everything is recomputed (blocks wholly past a sequence's end are never written: fill values)
    broken = _copy(done, tmp_path / "broken")
    manifest = json.loads((broken.path / "manifest.json").read_text())
    manifest["lens"]["computed"] = None
    group = zarr.open_group(str(broken.path / "tensors.zarr"), mode="a")
    chunk = manifest["spec_resolved"]["output"]["chunk_steps"]
    for seq, n in enumerate(done.generated_len()):
        end = min(-(-int(n) // chunk) * chunk, N)  # the end of the last block holding a real step
        group["lens_probs"][seq, :end] = 0.5
        group["lens_ids"][seq, :end] = 7
    steps = pq.read_table(broken.path / "steps.parquet")
    steps = steps.set_column(steps.schema.get_field_index("lens_margin"), "lens_margin", steps.column("resid_norm"))
    pq.write_table(steps, broken.path / "steps.parquet")
    # the interrupted lens noted the steps.parquet it was replacing the recorded one with
    import hashlib

    new_steps = (broken.path / "steps.parquet").read_bytes()
    manifest["checksums_recording"] = {
        "sha256": manifest["checksums"]["sha256"],
        "files": {"steps.parquet": [len(new_steps), hashlib.sha256(new_steps).hexdigest()]},
    }
    (broken.path / "manifest.json").write_text(json.dumps(manifest))
    assert not _steps(Run(broken.path)).lens_margin.equals(_steps(done).lens_margin)
    assert compute_lens(Run(broken.path))["computed"] is True
    broken = Run(broken.path)
    for name in ("lens_ids", "lens_probs"):
        np.testing.assert_array_equal(broken.array(name)[:], done.array(name)[:], err_msg=name)
    pd.testing.assert_frame_equal(_steps(broken), _steps(done), check_exact=True)


# ---- c. the command ---------------------------------------------------------------------------
def test_cli_lens_computes_once_and_refuses_with_one_line(runs, tmp_path, tiny_llama_dir):
    a = _copy(runs["base"], tmp_path / "runs")
    b = _copy(runs["float32", "deferred"], tmp_path / "runs")
    spec = _spec(tiny_llama_dir, max_new_tokens=2)
    none = run_spec(tmp_path, {**spec, "capture": "none"})  # under tmp_path/runs, as the CLI helper uses
    off = run_spec(tmp_path, {**spec, "capture": {**spec["capture"], "lens": {"enabled": False}}})

    proc = lmtrace(tmp_path, "lens", a.id)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    rows = int(a.generated_len().sum()) * len(LAYERS)
    assert proc.stdout.splitlines() == [proc.stdout.strip()], proc.stdout  # one line
    assert proc.stdout.startswith(f"{a.id}: logit lens computed ({rows} rows, "), proc.stdout
    assert lens_state(Run(a.path).manifest) == "ready" and Run(a.path).array("lens_ids").shape[2] == len(LAYERS)

    proc = lmtrace(tmp_path, "lens", a.id[:-3])  # a unique prefix is enough
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{a.id}: logit lens already present"

    proc = lmtrace(tmp_path, "lens", str(a.path), b.id, "--json")  # several runs: one JSON object each
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(o["run_id"], o["computed"]) for o in out] == [(a.id, False), (b.id, True)]
    assert out[1]["rows"] == int(b.generated_len().sum()) * len(LAYERS)
    assert lens_state(Run(b.path).manifest) == "ready"

    assert_one_line_error(lmtrace(tmp_path, "lens", "nonexistent-run"), 2, "no run 'nonexistent-run'", "lmtrace ls")
    assert_one_line_error(
        lmtrace(tmp_path, "lens", none.id), 2, f"run {none.id} captured no logit lens", "capture: none"
    )
    assert_one_line_error(lmtrace(tmp_path, "lens", off.id), 2, f"run {off.id} captured no logit lens")
    assert_one_line_error(lmtrace(tmp_path, "lens"), 2, "Missing argument")
    assert lens_state(Run(none.path).manifest) == "none" and not (tmp_path / "runs" / "nonexistent-run").exists()


# ---- d. compare says how to get the lens figures ------------------------------------------------
def test_compare_notes_a_pending_lens_and_compares_it_once_computed(runs, tmp_path):
    a = _copy(runs["base"], tmp_path / "a")
    b = _copy(runs["float32", "deferred"], tmp_path / "b")

    def lens_notes(cmp_notes):
        return [n for n in cmp_notes if "lmtrace lens" in n]

    cmp = compare_runs(a.path, b.path)
    notes = lens_notes(cmp.notes)
    assert len(notes) == 2 and f"`lmtrace lens {a.id}`" in notes[0] and f"`lmtrace lens {b.id}`" in notes[1]
    assert cmp.per_layer.num_rows > 0 and cmp.per_layer.to_pandas().lens_changed.isna().all()
    res = CliRunner().invoke(app, ["compare", str(a.path), str(b.path), "--json"])
    assert res.exit_code == 0, res.output
    assert lens_notes(json.loads(res.stdout)["notes"]) == notes

    compute_lens(a)
    cmp = compare_runs(a.path, b.path)
    assert [f"`lmtrace lens {b.id}`" in n for n in lens_notes(cmp.notes)] == [True]
    compute_lens(b)
    cmp = compare_runs(a.path, b.path)
    assert lens_notes(cmp.notes) == []
    # the per-layer lens figure, recomputed from the two steps tables
    layers = cmp.per_layer.to_pandas()
    sa, sb = _steps(Run(a.path)), _steps(Run(b.path))
    assert len(layers) > 0 and layers.lens_changed.notna().all()
    for _, row in layers.iterrows():
        ta = sa[(sa.sequence == row.seq_a) & (sa.step == row.step) & (sa.layer == row.layer)].lens_top1.item()
        tb = sb[(sb.sequence == row.seq_b) & (sb.step == row.step) & (sb.layer == row.layer)].lens_top1.item()
        assert row.lens_changed == float(ta != tb)
