"""Shared fixtures, for every directory under tests/: tiny random models and the runs made once per
session. Plain helpers (in-process runs, the reference forward, the CLI as a subprocess, ...) are in
tests/helpers/; a test module imports from there, never from another test module or from here.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning, module="zarr")

from tests.helpers.runs import PROMPTS, run_spec  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A randomly initialised 4-layer GQA Llama with the embedded model's tokenizer (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    tok = load_model(ModelSpec()).tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sharp_llama_dir(tmp_path_factory, tiny_llama_dir):
    """tiny_llama_dir with larger random weights: peaked distributions, so that ablating one head moves
    probabilities and KL far beyond the tolerance (with the default init every effect is below 1e-4)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if "embed" not in name else 1.0)
    path = tmp_path_factory.mktemp("sharp-llama")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return path


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
    base = run_spec(
        root,
        {
            "model": str(tiny_llama_dir),
            "prompts": {"file": str(prompts)},
            "generation": {"max_new_tokens": 4, "batch_size": 3},
            "capture": {"lens": {"when": "inline"}, "head_dla": True, "prefill_attention": True},
            "output": {"float_dtype": "float32", "run_id": "every-table"},
        },
    )
    heads_command(str(base.path), quiet=True, per_sequence=True)
    heads_command(str(base.path), quiet=True, by="topic")
    run_sweep(
        str(base.path),
        SweepSpec(
            over="heads", metrics=["logprob", "prob", "kl", "rank", "logit_diff:42,7"], sequences="0,1", steps="1,2"
        ),
    )
    run_sweep(
        str(base.path),
        SweepSpec(
            over="attn", edit="patch", source=str(base.path), metrics=["logprob", "rank"], sequences="0", steps="1"
        ),
    )
    explain_run(base.path, "1,2", methods=["grad_x_input,occlusion"])
    run_intervene(str(base.path), [{"kind": "ablate_layer", "layer": 1}], run_id="every-table-child")
    compare_view(str(base.path), str(root / "runs" / "every-table-child"), out_dir=root / "compare", quiet=True)
    return root
