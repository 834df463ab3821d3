"""The spec layer, in-process: schema defaults, shorthands, `--set` overrides, layer resolution,
prompt files and the one-line messages for bad specs. Fast: no model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtrace.exits.errors import EXIT_USAGE, SpecError
from lmtrace.spec.prompts import load_prompts
from lmtrace.spec.run_spec import (
    DEFAULT_MODEL,
    LayerStride,
    PromptsSpec,
    apply_override,
    build_spec,
    load_spec,
    resolve_layers,
    resolve_vector_layers,
)


def spec_error(data) -> str:
    with pytest.raises(SpecError) as info:
        build_spec(data, "spec.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert info.value.exit_code == EXIT_USAGE
    return message


# ---- defaults and shorthands -----------------------------------------------------------------
def test_defaults():
    spec = build_spec({"prompts": ["hi"]}, "t")
    assert spec.model.ref == DEFAULT_MODEL == "embedded:smollm2-135m"
    assert (spec.model.device, spec.model.dtype, spec.model.attn_implementation) == ("auto", "auto", "sdpa")
    assert spec.model.revision is None and spec.model.trust_remote_code is False
    g = spec.generation
    assert (g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.seed, g.batch_size) == (32, 0.0, 0, 1.0, 0, 8)
    assert g.eos_token_id is None and g.stop == []
    c = spec.capture
    assert c.preset == "standard" and c.layers == "all" and c.attention.enabled and c.attention.top_k is None
    assert not c.qkv and c.residual.dtype == "float16"  # the standard preset
    assert c.ffn.top_k == 32 and c.lens.top_k == 5 and c.alternatives == 10 and c.residual.vectors_at == []
    assert not c.forward_only
    o = spec.output
    assert (o.runs_dir, o.run_id, o.chunk_steps, o.codec, o.level, o.float_dtype) == (
        None,
        None,
        16,
        "auto",
        1,
        "float16",
    )
    assert o.chunk_sequences == 32
    assert spec.prompts.texts == ["hi"] and spec.prompts.file is None and spec.prompts.chat is False


def test_capture_presets_set_defaults_that_given_keys_override():
    def capture(data):
        return build_spec({"prompts": ["hi"], "capture": data}, "t").capture

    full, light = capture({"preset": "full"}), capture({"preset": "light"})
    assert full.qkv and full.residual.dtype == "float32" and full.attention.top_k is None and full.lens.enabled
    assert not light.qkv and light.attention.top_k == 8 and not light.ffn.enabled and not light.lens.enabled
    # keys given win, nested ones key by key: the rest of the preset's mapping still applies
    mixed = capture({"preset": "light", "lens": {"top_k": 3}, "attention": {"enabled": True}, "qkv": True})
    assert mixed.qkv and mixed.lens.top_k == 3 and not mixed.lens.enabled and mixed.attention.top_k == 8
    assert capture({"preset": "full", "residual": {"dtype": "float16"}}).residual.dtype == "float16"
    assert capture("none").forward_only  # `capture: none` is not a preset's
    with pytest.raises(SpecError) as err:
        capture({"preset": "huge"})
    assert "capture.preset" in str(err.value)


def test_shorthands():
    spec = build_spec({"model": "org/name", "prompts": ["a", "b"], "capture": "none"}, "t")
    assert spec.model.ref == "org/name" and spec.model.device == "auto"
    assert spec.prompts.texts == ["a", "b"]
    assert spec.capture.forward_only
    assert build_spec({"prompts": ["a"], "capture": "None"}, "t").capture.forward_only  # as a Python user writes it


def test_empty_sections_mean_defaults():
    # `generation:` with everything under it commented out is YAML null
    spec = build_spec({"prompts": ["a"], "generation": None, "output": None, "model": None}, "t")
    assert spec.generation.max_new_tokens == 32 and spec.model.ref == DEFAULT_MODEL
    msg = spec_error({"prompts": ["a"], "capture": None})  # ambiguous: say what to write instead
    assert "capture: none" in msg


def test_spec_must_be_a_mapping_with_prompts():
    assert "empty" in spec_error(None)
    assert "mapping" in spec_error(["a"])
    msg = spec_error({"generation": {"seed": 1}})
    assert "prompts: required key is missing" in msg and "file:" in msg


# ---- one-line validation messages ------------------------------------------------------------
def test_unknown_key_names_the_dotted_path_and_suggests():
    msg = spec_error({"prompts": ["a"], "generation": {"max_new_tokenz": 3}})
    assert msg.startswith("spec.yaml: generation.max_new_tokenz: unknown key")
    assert "did you mean 'max_new_tokens'" in msg
    assert "unknown key" in spec_error({"prompts": ["a"], "promts": 1}) and "top level" in spec_error(
        {"prompts": ["a"], "x": 1}
    )


def test_wrong_type_and_range_name_the_path_and_value():
    msg = spec_error({"prompts": ["a"], "generation": {"top_k": "abc"}})
    assert msg.startswith("spec.yaml: generation.top_k: ") and "integer" in msg and "(got 'abc')" in msg
    msg = spec_error({"prompts": ["a"], "generation": {"top_p": 2}})
    assert msg.startswith("spec.yaml: generation.top_p: ") and "less than or equal to 1" in msg and "(got 2)" in msg
    msg = spec_error({"prompts": ["a"], "model": {"device": "gpu"}})
    assert msg.count("got 'gpu'") == 1 and "Value error" not in msg


def test_union_fields_get_a_readable_message():
    msg = spec_error({"prompts": ["a"], "capture": {"layers": "some"}})
    assert "capture.layers: expected `all`, a list of layer indices" in msg and "[+" not in msg
    assert "capture.layers.1: " in spec_error({"prompts": ["a"], "capture": {"layers": [1, "x"]}})
    assert "capture.layers.stride: " in spec_error({"prompts": ["a"], "capture": {"layers": {"stride": 0}}})
    msg = spec_error({"prompts": ["a"], "capture": {"layers": {"strid": 2}}})
    assert "capture.layers.strid: unknown key; did you mean 'stride'" in msg
    assert "generation.eos_token_id: expected a token id" in spec_error(
        {"prompts": ["a"], "generation": {"eos_token_id": "x"}}
    )


def test_several_problems_are_counted():
    msg = spec_error({"prompts": ["a"], "generation": {"top_k": "x", "top_p": 5, "seed": -1}})
    assert msg.startswith("spec.yaml: generation.top_k:") and msg.endswith("[+2 more problems]")


def test_prompts_texts_and_file_rules():
    assert "prompts.texts is empty" in spec_error({"prompts": []})
    assert "either prompts.texts" in spec_error({"prompts": {"texts": ["a"], "file": "x.txt"}})
    assert "either prompts.texts" in spec_error({"prompts": {"chat": True}})
    msg = spec_error({"prompts": {"texts": ["a"], "system": "be brief"}})
    assert msg == "spec.yaml: prompts.system needs prompts.chat: true"
    assert build_spec({"prompts": {"texts": ["a"], "system": "s", "chat": True}}, "t").prompts.system == "s"
    assert "output.run_id" in spec_error({"prompts": ["a"], "output": {"run_id": "a/b"}})


# ---- --set overrides -------------------------------------------------------------------------
def test_apply_override_creates_nested_keys_and_parses_yaml():
    data: dict = {}
    apply_override(data, "generation.seed=3")
    apply_override(data, "a.b.c=true")
    apply_override(data, "capture.layers=[0, -1]")
    apply_override(data, "generation.temperature=0.5")
    apply_override(data, "prompts.system=a=b")  # only the first '=' splits
    apply_override(data, "output.run_id=null")
    apply_override(data, "model.ref= org/name ")
    assert data == {
        "generation": {"seed": 3, "temperature": 0.5},
        "a": {"b": {"c": True}},
        "capture": {"layers": [0, -1]},
        "prompts": {"system": "a=b"},
        "output": {"run_id": None},
        "model": {"ref": "org/name"},
    }


def test_apply_override_expands_shorthands_and_reports_errors():
    data = {"model": "embedded:smollm2-135m", "prompts": ["a"]}
    apply_override(data, "model.device=cpu")
    apply_override(data, "prompts.chat=true")
    assert data == {
        "model": {"ref": "embedded:smollm2-135m", "device": "cpu"},
        "prompts": {"texts": ["a"], "chat": True},
    }
    with pytest.raises(SpecError, match="expected KEY=VALUE"):
        apply_override({}, "generation.seed")
    with pytest.raises(SpecError, match="key before '=' is empty"):
        apply_override({}, "=3")
    with pytest.raises(SpecError, match=r"capture is 'none' in the spec, not a section"):
        apply_override({"capture": "none"}, "capture.layers=all")
    with pytest.raises(SpecError, match=r"--set generation.seed: malformed YAML"):
        apply_override({}, "generation.seed=[1")


def test_load_spec_applies_overrides_and_keeps_the_given_text(tmp_path):
    path = tmp_path / "s.yaml"
    text = "model: embedded:smollm2-135m\nprompts: [hi]\ngeneration: {seed: 1}\n"
    path.write_text(text)
    spec, given, data = load_spec(path, ["generation.seed=3", "model.device=cpu", "capture=none"])
    assert given == text
    assert spec.generation.seed == 3 and spec.model.device == "cpu" and spec.capture.forward_only
    assert data["generation"] == {"seed": 3}
    spec, _, _ = load_spec(path)  # the file itself is unchanged
    assert spec.generation.seed == 1


def test_load_spec_file_errors(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)
    (tmp_path / "bad.yaml").write_text("prompts: [hi]\ngeneration:\n  seed: 1\n  top_k: a: b\n")
    with pytest.raises(SpecError, match=r"malformed YAML at line 4, column 11"):
        load_spec(tmp_path / "bad.yaml")
    (tmp_path / "tab.yaml").write_text("prompts: [hi]\ngeneration:\n\tseed: 1\n")
    with pytest.raises(SpecError, match=r"line 3, column 1: .*spaces, not tabs"):
        load_spec(tmp_path / "tab.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(SpecError, match="not a UTF-8 text file"):
        load_spec(tmp_path / "bin.yaml")


# ---- layers ----------------------------------------------------------------------------------
def test_resolve_layers():
    assert resolve_layers("all", 4) == [0, 1, 2, 3]
    assert resolve_layers([5, 0, -1, 29, -30], 30) == [0, 5, 29]
    assert resolve_layers(LayerStride(stride=10), 30) == [0, 10, 20]
    assert resolve_layers(LayerStride(stride=4, start=2), 12) == [2, 6, 10]
    with pytest.raises(SpecError, match=r"capture.layers: \[99, -31\] out of range: the model has layers 0\.\.29"):
        resolve_layers([1, 99, -31], 30)
    with pytest.raises(SpecError, match=r"capture.layers.start=30 is out of range: the model has layers 0\.\.29"):
        resolve_layers(LayerStride(stride=1, start=30), 30)
    with pytest.raises(SpecError, match="capture.layers is empty"):
        resolve_layers([], 30)


def test_resolve_vector_layers():
    inline = {"lens": {"when": "inline"}}
    spec = build_spec({"prompts": ["a"], "capture": {"residual": {"vectors_at": [0, 15, -1]}, **inline}}, "t")
    assert resolve_vector_layers(spec.capture, 30) == [0, 15, 29]
    # a deferred logit lens (the default) reads the residual of every captured layer: they are added
    spec = build_spec({"prompts": ["a"], "capture": {"residual": {"vectors_at": [0, 15, -1]}}}, "t")
    assert spec.capture.lens_deferred and resolve_vector_layers(spec.capture, 30) == list(range(30))
    spec = build_spec(
        {"prompts": ["a"], "capture": {"layers": {"stride": 10, "start": 5}, "residual": {"vectors_at": [0]}}}, "t"
    )
    assert resolve_vector_layers(spec.capture, 30) == [0, 5, 15, 25]
    for capture in ({"layers": [3], "lens": {"enabled": False}}, {"layers": [3], "lens": {"when": "inline"}}):
        spec = build_spec({"prompts": ["a"], "capture": capture}, "t")
        assert resolve_vector_layers(spec.capture, 30) == [], capture
    spec = build_spec({"prompts": ["a"], "capture": "none"}, "t")
    assert not spec.capture.lens_deferred and resolve_vector_layers(spec.capture, 30) == []
    spec = build_spec({"prompts": ["a"], "capture": {"residual": {"vectors_at": "all"}}}, "t")
    assert resolve_vector_layers(spec.capture, 3) == [0, 1, 2]
    spec = build_spec({"prompts": ["a"], "capture": {"residual": {"vectors_at": [30]}}}, "t")
    with pytest.raises(SpecError, match=r"vectors_at: \[30\] out of range: the model has layers 0\.\.29"):
        resolve_vector_layers(spec.capture, 30)


# ---- prompt files ----------------------------------------------------------------------------
def prompts_from(path: Path, column: str | None = None) -> list[str]:
    return load_prompts(PromptsSpec(file=str(path), column=column))


def test_txt_one_prompt_per_line_skipping_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n   \nsecond, with  spaces \r\nthird\n", encoding="utf-8")
    assert prompts_from(f) == ["first prompt", "second, with  spaces ", "third"]
    f.write_bytes("\ufeffé prompt\n".encode("utf-8"))  # a BOM from a Windows editor is not part of the prompt
    assert prompts_from(f) == ["é prompt"]


def test_jsonl_strings_and_objects(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('"plain string"\n\n{"prompt": "from object", "id": 1}\n{"text": "text column", "id": 2}\n')
    assert prompts_from(f) == ["plain string", "from object", "text column"]
    f.write_text('{"q": "a", "id": 1}\n{"q": "b", "id": 2}\n')
    assert prompts_from(f, column="q") == ["a", "b"]
    with pytest.raises(SpecError, match=r"p.jsonl:1: cannot tell which column .*columns: q, id.*set prompts.column"):
        prompts_from(f)
    f.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(SpecError, match=r"p.jsonl:2: not valid JSON"):
        prompts_from(f)
    f.write_text('{"prompt": "ok"}\n{"prompt": null}\n')
    with pytest.raises(SpecError, match=r"p.jsonl:2: the prompt is missing"):
        prompts_from(f)
    f.write_text('["a list"]\n')
    with pytest.raises(SpecError, match=r"p.jsonl:1: each line must be a JSON string or object"):
        prompts_from(f)


def test_csv_with_column_and_autodetection(tmp_path):
    f = tmp_path / "p.csv"
    f.write_text('id,question,notes\n1,"What is 2+2?",x\n2,"Say ""hi"", please",y\n')
    assert prompts_from(f, column="question") == ["What is 2+2?", 'Say "hi", please']
    with pytest.raises(
        SpecError,
        match=r"cannot tell which column holds the prompts \(columns: id, question, notes\); set prompts.column",
    ):
        prompts_from(f)
    with pytest.raises(SpecError, match=r"no column 'prompt' \(columns: id, question, notes\)"):
        prompts_from(f, column="prompt")
    f.write_text("id,Prompt\n1,hello\n2,world\n")  # a known name, any case
    assert prompts_from(f) == ["hello", "world"]
    f.write_text("only\nx\ny\n")  # a single column is unambiguous
    assert prompts_from(f) == ["x", "y"]


def test_parquet_with_column_and_autodetection(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["alpha", "beta"]}), f)
    assert prompts_from(f) == ["alpha", "beta"]
    pq.write_table(pa.table({"id": [1, 2], "body": ["alpha", "beta"]}), f)
    assert prompts_from(f, column="body") == ["alpha", "beta"]
    with pytest.raises(SpecError, match=r"cannot tell which column holds the prompts \(columns: id, body\)"):
        prompts_from(f)
    pq.write_table(pa.table({"prompt": ["alpha", None]}), f)
    with pytest.raises(SpecError, match=r"row 1: the prompt is missing"):
        prompts_from(f)
    f.write_text("not parquet")
    with pytest.raises(SpecError, match="cannot read .* as Parquet"):
        prompts_from(f)


def test_prompt_file_errors(tmp_path):
    with pytest.raises(SpecError, match=r"prompts.file: .*missing.txt does not exist"):
        prompts_from(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(SpecError, match=r"empty.txt contains no prompts"):
        prompts_from(empty)
    other = tmp_path / "p.json"
    other.write_text("[]")
    with pytest.raises(SpecError, match=r"unsupported prompt file type '.json'; use .txt, .jsonl, .csv or .parquet"):
        prompts_from(other)
    with pytest.raises(SpecError, match="prompt 1 is empty"):
        load_prompts(PromptsSpec(texts=["a", ""]))


def test_relative_prompt_file_is_resolved_against_the_spec_directory(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "prompts.txt").write_text("from the spec dir\n")
    (tmp_path / "prompts.txt").write_text("from the cwd\n")
    spec_path = tmp_path / "configs" / "s.yaml"
    spec_path.write_text("prompts:\n  file: prompts.txt\n")
    monkeypatch.chdir(tmp_path)
    spec, _, _ = load_spec(Path("configs/s.yaml"))
    assert Path(spec.prompts.file) == (tmp_path / "configs" / "prompts.txt").resolve()
    assert load_prompts(spec.prompts) == ["from the spec dir"]
    # a path typed on the command line is relative to where the command runs
    spec, _, _ = load_spec(Path("configs/s.yaml"), ["prompts.file=prompts.txt"])
    assert load_prompts(spec.prompts) == ["from the cwd"]


def test_setting_one_prompts_source_replaces_the_other(tmp_path, monkeypatch):
    """`--set prompts.file=x.txt` on a spec with inline texts (and the reverse) takes the new source
    instead of failing with "give either prompts.texts or prompts.file"."""
    (tmp_path / "more.txt").write_text("one\ntwo\n")
    inline = tmp_path / "inline.yaml"
    inline.write_text("prompts: [a, b, c]\n")
    from_file = tmp_path / "file.yaml"
    from_file.write_text("prompts:\n  file: more.txt\n  chat: true\n")
    monkeypatch.chdir(tmp_path)
    spec, _, _ = load_spec(inline, ["prompts.file=more.txt"])
    assert spec.prompts.texts is None and load_prompts(spec.prompts) == ["one", "two"]
    spec, _, _ = load_spec(from_file, ["prompts.texts=[x]"])
    assert spec.prompts.file is None and spec.prompts.texts == ["x"] and spec.prompts.chat is True


# ---- validate's model inspection (no weights) ------------------------------------------------
def test_gguf_header_gives_the_embedded_model_sizes():
    from lmtrace.runner.model_config import gguf_config
    from lmtrace.runner.models import embedded_gguf

    cfg = gguf_config(embedded_gguf("smollm2-135m"))
    assert cfg["num_hidden_layers"] == 30 and cfg["num_attention_heads"] == 9 and cfg["hidden_size"] == 576
    assert cfg["num_key_value_heads"] == 3 and cfg["intermediate_size"] == 1536


def test_classify_model_agrees_with_locate(tmp_path):
    from lmtrace.runner.model_config import classify_model
    from lmtrace.runner.models import locate
    from lmtrace.spec.run_spec import ModelSpec

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for ref in ("embedded:smollm2-135m", str(tmp_path / "ckpt"), str(tmp_path / "m.gguf"), "org/name"):
        kind, source, _, _ = locate(ModelSpec(ref=ref))
        assert classify_model(ModelSpec(ref=ref)) == (kind, source)
    for ref in ("embedded:nope", str(tmp_path / "missing"), "./missing", str(tmp_path / "x.gguf"), str(tmp_path)):
        with pytest.raises(SpecError) as ours:
            classify_model(ModelSpec(ref=ref))
        with pytest.raises(SpecError) as theirs:
            locate(ModelSpec(ref=ref))
        assert str(ours.value) == str(theirs.value)


def test_validate_spec_checks_layers_against_the_model(tmp_path):
    from lmtrace.commands.validate import validate_spec

    path = tmp_path / "s.yaml"
    path.write_text("prompts: [hi]\ncapture:\n  layers: [0, -1]\n")
    report = validate_spec(path, [])
    assert report["model"]["layers"] == 30 and report["resolved"]["capture"]["layers"] == [0, -1]
    assert "2 of 30 layers captured" in report["summary"]
    with pytest.raises(SpecError, match=r"capture.layers: \[99\] out of range: the model has layers 0\.\.29"):
        validate_spec(path, ["capture.layers=[99]"])
    cfg = tmp_path / "ckpt"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}))
    assert validate_spec(path, [f"model={cfg}", "capture.layers=all"])["model"]["layers"] == 2


def test_head_dla_needs_the_model_on_one_device():
    assert "capture.head_dla with model.device_map is not supported" in spec_error(
        {"prompts": ["a"], "model": {"device_map": "auto"}, "capture": {"head_dla": True}}
    )
