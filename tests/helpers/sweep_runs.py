"""The sweep tests' tiny setup: a clean and a corrupted run of the same tiny model (prompts of equal token
length, so that patching pairs positions), the model loaded for the test's own forwards, and a run's
prompt and generated token ids."""

from __future__ import annotations

import json

import torch

from tests.helpers.runs import run_spec

CLEAN = ["The quick brown fox", "Paris is the capital of"]
CORRUPT = ["The slow brown cat", "Rome is the capital of"]


def sweep_run(tmp, model_dir, prompts, run_id):
    """A generate run of `prompts` (4 sampled tokens each, no capture) under tmp, id `run_id`."""
    return run_spec(
        tmp,
        {
            "model": str(model_dir),
            "prompts": prompts,
            "capture": "none",
            "generation": {"max_new_tokens": 4, "batch_size": 2, "temperature": 0.9, "seed": 5},
            "output": {"run_id": run_id},
        },
    )


def eager_model(model_dir):
    """The model as the tests run it themselves: eager attention, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()


def sequence_ids(run, seq):
    """(prompt token ids, generated token ids) of sequence `seq` of `run`."""
    t = run.tokens().to_pandas()
    t = t[t.sequence == seq]
    return (
        t[t.is_prompt].sort_values("position").token_id.tolist(),
        t[~t.is_prompt].sort_values("step").token_id.tolist(),
    )


def feature_sweep_run(tmp, model_dir, features: str = "1,4,9"):
    """A run of CLEAN with one finished feature sweep (`--over features --features ...`, zero, logprob) of a
    random SAE named `sae-l1` at blocks.1.hook_resid_post: (run, sweep directory)."""
    from lmtrace.commands.sweep import run_sweep
    from lmtrace.spec.sweep_spec import SweepSpec
    from tests.helpers.saes import random_sae

    run = sweep_run(tmp, model_dir, CLEAN, "features")
    sae = tmp / "sae-l1"
    width = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    random_sae(sae, "blocks.1.hook_resid_post", width, 16)
    spec = SweepSpec(over="features", sae=str(sae), features=features, metrics=["logprob"])
    return run, run_sweep(str(run.path), spec).path
