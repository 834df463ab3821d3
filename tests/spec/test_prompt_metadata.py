"""A prompt file's other columns reach sequences.parquet with their types (compared with pandas
reading the prompt file itself), through sharded runs, resumes and intervene children."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from lmtrace.archive.reader import Run
from lmtrace.archive.rundir import Shard
from lmtrace.exits.errors import LmtraceError, SpecError
from lmtrace.output.progress import Progress
from lmtrace.runner.generation import run_generate
from lmtrace.spec.prompts import load_prompts_and_metadata
from lmtrace.spec.run_spec import PromptsSpec, build_spec

ROWS = [  # prompt, then metadata of every type, with a null in each column
    {"prompt": "The cat sat", "id": 10, "label": "a", "score": 0.25, "ok": True},
    {"prompt": "Paris is the", "id": 11, "label": None, "score": 1.5, "ok": False},
    {"prompt": "One two three", "id": None, "label": "c", "score": None, "ok": None},
]
TYPES = {"id": pa.int64(), "label": pa.string(), "score": pa.float64(), "ok": pa.bool_()}


def write_prompt_file(tmp_path: Path, kind: str) -> Path:
    f = tmp_path / f"prompts.{kind}"
    if kind == "jsonl":
        # a missing key is a null too
        f.write_text("\n".join(json.dumps({k: v for k, v in r.items() if v is not None}) for r in ROWS) + "\n")
    elif kind == "csv":
        cell = lambda v: "" if v is None else str(v)  # noqa: E731 - bools as pandas writes them: True / False
        f.write_text("prompt,id,label,score,ok\n" + "".join(",".join(cell(r[k]) for k in r) + "\n" for r in ROWS))
    else:
        pq.write_table(pa.table({k: pa.array([r[k] for r in ROWS], TYPES.get(k, pa.string())) for k in ROWS[0]}), f)
    return f


def pandas_reads(f: Path) -> pd.DataFrame:
    if f.suffix == ".jsonl":
        return pd.read_json(f, lines=True)
    if f.suffix == ".csv":
        return pd.read_csv(f)
    return pd.read_parquet(f)


def same_value(a, b) -> bool:
    missing = lambda v: v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA  # noqa: E731
    if missing(a) or missing(b):
        return missing(a) and missing(b)
    return a == b  # the type is checked on its own: pandas turns a bool column with a null into floats


def assert_matches_pandas(table: pa.Table, f: Path, prefix: dict[str, str] | None = None) -> None:
    """`table`'s metadata columns hold what pandas reads from the prompt file (nulls where pandas has NaN / None),
    as the types the file implies."""
    frame = pandas_reads(f)
    for column in frame.columns:
        if column == "prompt":
            continue
        stored = (prefix or {}).get(column, column)
        assert table.schema.field(stored).type == TYPES[column], (f.suffix, column, table.schema.field(stored).type)
        expected = [None if pd.isna(v) else (v.item() if hasattr(v, "item") else v) for v in frame[column]]
        got = table.column(stored).to_pylist()
        assert all(same_value(g, e) for g, e in zip(got, expected)) and len(got) == len(expected), (
            column,
            got,
            expected,
        )


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_metadata_columns_are_read_with_their_types(tmp_path, kind):
    f = write_prompt_file(tmp_path, kind)
    prompts, metadata = load_prompts_and_metadata(PromptsSpec(file=str(f)))
    assert prompts == [r["prompt"] for r in ROWS]
    assert metadata.column_names == ["id", "label", "score", "ok"]
    assert_matches_pandas(metadata, f)


def test_reserved_names_are_prefixed_nested_values_are_json_text_and_mixed_types_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "a", "batch": 3, "tags": ["x", 1], "cfg": {"k": 1}}\n{"text": "b", "batch": 4}\n"plain"\n')
    prompts, metadata = load_prompts_and_metadata(PromptsSpec(file=str(f)))
    assert prompts == ["a", "b", "plain"]
    assert metadata.to_pydict() == {
        "meta_batch": [3, 4, None],
        "tags": ['["x", 1]', None, None],
        "cfg": ['{"k": 1}', None, None],
    }
    f.write_text('{"prompt": "a", "batch": 1, "meta_batch": 2}\n')
    with pytest.raises(SpecError, match=r"column 'batch' would be stored as 'meta_batch', which the file also has"):
        load_prompts_and_metadata(PromptsSpec(file=str(f)))
    f.write_text('{"prompt": "a", "n": 1}\n{"prompt": "b", "n": "two"}\n')
    with pytest.raises(SpecError, match=r"p.jsonl:2: column 'n' holds a string here but a int on line 1"):
        load_prompts_and_metadata(PromptsSpec(file=str(f)))
    f.write_text('{"prompt": "a", "n": 1}\n{"prompt": "b", "n": 2.5}\n')  # ints and floats: float64
    assert load_prompts_and_metadata(PromptsSpec(file=str(f)))[1].column("n").type == pa.float64()
    c = tmp_path / "p.csv"
    c.write_text(",prompt,n\n0,x,1\n1,y,1\n")  # pandas' index column: no name
    assert load_prompts_and_metadata(PromptsSpec(file=str(c)))[1].column_names == ["column_1", "n"]
    c.write_text("prompt,n,n\nx,1,2\n")
    with pytest.raises(SpecError, match=r"the header names column 'n' twice"):
        load_prompts_and_metadata(PromptsSpec(file=str(c)))
    assert load_prompts_and_metadata(PromptsSpec(texts=["a"]))[1] is None


def _spec(tmp_path: Path, model: Path, prompts: Path, **generation) -> tuple:
    data = {
        "model": {"ref": str(model), "device": "cpu"},
        "prompts": {"file": str(prompts)},
        "capture": "none",
        "generation": {"max_new_tokens": 3, "batch_size": 2, **generation},
        "output": {"runs_dir": str(tmp_path / "runs")},
    }
    return build_spec(data, "test-spec"), yaml.safe_dump(data)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_metadata_reaches_sequences_parquet_and_joins_every_table(tmp_path, tiny_llama_dir, kind):
    f = write_prompt_file(tmp_path, kind)
    run = Run(run_generate(*_spec(tmp_path, tiny_llama_dir, f)).run_dir)
    seqs = pq.read_table(run.path / "sequences.parquet")
    assert seqs.column("sequence").to_pylist() == [0, 1, 2]
    assert_matches_pandas(seqs, f)
    assert run.manifest["prompt_metadata"] == {"id": "int64", "label": "string", "score": "double", "ok": "bool"}
    joined = pq.read_table(run.path / "tokens.parquet", columns=["sequence", "token_id"]).join(
        seqs.select(["sequence", "label"]), "sequence"
    )
    assert joined.num_rows == pq.read_metadata(run.path / "tokens.parquet").num_rows
    by_seq = {s: lab for s, lab in zip(joined.column("sequence").to_pylist(), joined.column("label").to_pylist())}
    assert by_seq == {0: "a", 1: None, 2: "c"}
    from lmtrace.viewdata.queries import sequence_page  # serve's sequence list shows them

    assert [r["metadata"] for r in sequence_page(run)["rows"]] == [
        {k: v for k, v in r.items() if k != "prompt"} for r in ROWS
    ]


def test_metadata_survives_shards_and_a_resume_and_a_changed_file_is_refused(tmp_path, tiny_llama_dir):
    f = write_prompt_file(tmp_path, "csv")
    spec, text = _spec(tmp_path, tiny_llama_dir, f, batch_size=1)
    sharded = spec.model_copy(update={"output": spec.output.model_copy(update={"run_id": "sharded"})})
    run_generate(sharded, text, shard=Shard(0, 2))
    run_generate(sharded, text, shard=Shard(1, 2))  # the last shard merges the sequences parts
    assert_matches_pandas(pq.read_table(tmp_path / "runs" / "sharded" / "sequences.parquet"), f)

    # a run that fails after its first batch, resumed with the same file
    failing = spec.model_copy(update={"output": spec.output.model_copy(update={"run_id": "resumed"})})
    seen = []

    def advance(tokens):
        seen.append(tokens)
        if len(seen) == 5:  # after the first batch (3 steps) was finished
            raise LmtraceError("stopped by the test")

    with pytest.raises(LmtraceError, match="stopped by the test"):
        run_generate(failing, text, progress=Progress(advance=advance))
    assert json.loads((tmp_path / "runs" / "resumed" / "manifest.json").read_text())["status"] == "failed"
    f.write_text(f.read_text().replace("0.25", "x"))  # score becomes a string column
    with pytest.raises(
        SpecError,
        match=r"metadata columns \(.*score: string.*\) differ from those the run was started "
        r"with \(.*score: double.*\)",
    ):
        run_generate(failing, text, resume=True)
    f = write_prompt_file(tmp_path, "csv")
    run_generate(failing, text, resume=True)
    assert_matches_pandas(pq.read_table(tmp_path / "runs" / "resumed" / "sequences.parquet"), f)


def test_an_intervene_child_carries_its_parents_metadata(tmp_path, tiny_llama_dir):
    from lmtrace.commands.intervene import run_intervene

    f = write_prompt_file(tmp_path, "parquet")
    parent = run_generate(*_spec(tmp_path, tiny_llama_dir, f))
    child, _ = run_intervene(str(parent.run_dir), [{"kind": "ablate_layer", "layer": 1}])
    assert_matches_pandas(pq.read_table(child.run_dir / "sequences.parquet"), f)
