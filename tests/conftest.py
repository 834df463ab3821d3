"""Shared fixtures: running specs in-process, tiny random models, and independent references.

References are the model's *own* full forward on the final sequence with eager attention,
`output_attentions=True` and `output_hidden_states=True`, never lmtrace's code.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning, module="zarr")

from lmtrace.archive.reader import Run  # noqa: E402
from lmtrace.runner.generation import run_generate  # noqa: E402
from lmtrace.spec.run_spec import build_spec  # noqa: E402

PROMPTS = ["The quick brown fox", "Paris is the capital of", "One, two, three, four, five, six, seven,"]


def run_spec(tmp_path: Path, data: dict) -> Run:
    data = dict(data)
    data.setdefault("output", {})
    data["output"] = {"runs_dir": str(tmp_path / "runs"), **data["output"]}
    spec = build_spec(data, "test-spec")
    import yaml

    result = run_generate(spec, yaml.safe_dump(data))
    return Run(result.run_dir)


def rerecord_checksums(path: Path) -> None:
    """After a test has edited a complete run's files on purpose (a hand-made archive, not a damaged
    one): record their checksums again, as the writer does at completion."""
    import json

    from lmtrace.archive.integrity import record

    manifest = json.loads((Path(path) / "manifest.json").read_text())
    manifest["checksums"] = record(Path(path))
    (Path(path) / "manifest.json").write_text(json.dumps(manifest))


def with_lens(run: Run) -> Run:
    """The run after `lmtrace lens` (the deferred logit lens, the default), reopened.

    Checks it really was deferred and pending, so a test that reads lens arrays through this
    helper exercises lmtrace/deferred_lens.py, not the inline lens."""
    from lmtrace.archive.reader import lens_state
    from lmtrace.commands.lens import compute_lens

    assert run.manifest["lens"]["when"] == "deferred" and lens_state(run.manifest) == "pending", run.manifest["lens"]
    assert compute_lens(run)["computed"] is True
    run = Run(run.path)
    assert lens_state(run.manifest) == "ready" and run.manifest["lens"]["computed"]["by"] == "lmtrace lens"
    return run


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A randomly initialised 4-layer GQA Llama with the embedded model's tokenizer (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    tok = load_model(ModelSpec()).tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


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
        h1 = layers[-1].register_forward_hook(lambda m, a, o: last.__setitem__("resid", (o[0] if isinstance(o, tuple) else o)[0]))
        down = {}
        hooks = [layers[i].mlp.down_proj.register_forward_pre_hook(
            (lambda i: lambda m, a: down.__setitem__(i, a[0][0]))(i)) for i in range(len(layers))]
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


@pytest.fixture(scope="session")
def every_table_runs(tmp_path_factory, tiny_llama_dir) -> Path:
    """A folder with every Parquet table lmtrace writes, from the tiny Llama: runs/ holds a generate
    run (inline lens, head DLA, prefill attention, a prompt-metadata column `topic`) with `lmtrace
    heads` (--per-sequence, --by topic), a head sweep measuring every metric, a patching sweep,
    attributions (grad_x_input, occlusion) and an intervene child (effects); compare/ holds
    `lmtrace compare --out` of the two runs. Tests that change it work on a copy."""
    import json

    from lmtrace.commands.compare import compare_view
    from lmtrace.commands.explain import explain_run
    from lmtrace.commands.heads import heads_command
    from lmtrace.commands.intervene import run_intervene
    from lmtrace.commands.sweep import run_sweep
    from lmtrace.spec.sweep_spec import SweepSpec

    root = tmp_path_factory.mktemp("every-table")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "topic": t}) + "\n" for p, t in zip(PROMPTS, ("a", "a", "b"))))
    base = run_spec(root, {
        "model": str(tiny_llama_dir), "prompts": {"file": str(prompts)},
        "generation": {"max_new_tokens": 4, "batch_size": 3},
        "capture": {"lens": {"when": "inline"}, "head_dla": True, "prefill_attention": True},
        "output": {"float_dtype": "float32", "run_id": "every-table"}})
    heads_command(str(base.path), quiet=True, per_sequence=True)
    heads_command(str(base.path), quiet=True, by="topic")
    run_sweep(str(base.path), SweepSpec(over="heads", metrics=["logprob", "prob", "kl", "rank", "logit_diff:42,7"],
                                        sequences="0,1", steps="1,2"))
    run_sweep(str(base.path), SweepSpec(over="attn", edit="patch", source=str(base.path), metrics=["logprob", "rank"],
                                        sequences="0", steps="1"))
    explain_run(base.path, "1,2", methods=["grad_x_input,occlusion"])
    run_intervene(str(base.path), [{"kind": "ablate_layer", "layer": 1}], run_id="every-table-child")
    compare_view(str(base.path), str(root / "runs" / "every-table-child"), out_dir=root / "compare", quiet=True)
    return root
