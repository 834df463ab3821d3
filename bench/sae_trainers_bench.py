"""Three SAE trainers on the same activations and the same wall-clock budget, measured by lmtrace's own
metrics: lmtrace's trainer (`lmtrace sae train`), SAELens's (`sae-lens`) and `dictionary-learning`'s.

The data (`dump`, lmtrace's venv): the embedded SmolLM2-135M reading the Python documentation that
CPython ships (`pydoc_data.topics`, cut into ~96-word prompts by scripts/sae_text_prompts.py, the text
docs/features.md trains on), layer 10 `resid_post`, every position but the first (what `sae train
--source replay` collects), the first --prompts prompts; a seeded 10 % of them is held out. Saved
once as float32 .npy (train.npy, heldout.npy) with the held-out token ids.

Each trainer (`train --trainer NAME`, run by the venv that has it) trains a TopK SAE, 2,304 latents,
k 32, batch 256 rows, seed 0, on train.npy for about --budget seconds on --threads torch threads: the
steps planned from the step time of 10 untimed warm-up steps (its learning-rate schedule is sized from
them); SAELens and dictionary-learning are stepped here, in seeded random orders of the rows, and also
stop when the budget is spent; lmtrace's trainer runs one epoch over train.npy repeated to the planned
steps (it cannot stop on time). Each keeps its own defaults otherwise (learning rate, auxiliary loss,
initialisation, input scaling) and writes an SAELens directory (SAELens: its own
`save_inference_model`; dictionary-learning: its weights converted here, W_enc = encoder.weightᵀ,
b_enc = encoder.bias, W_dec = decoder.weightᵀ, b_dec).

Then (lmtrace's venv) each directory is read with lmtrace's reader and measures it with
lmtrace/analysis/features/metrics.py on the held-out activations and sequences: explained variance,
mean L0, dead latents, CE loss recovered.

The venvs (never lmtrace's own .venv; torch first, the CPU wheel lmtrace pins):

    python3 -m venv /work/venv-saelens
    /work/venv-saelens/bin/pip install -c constraints.txt torch==2.13.0
    /work/venv-saelens/bin/pip install -c constraints.txt sae-lens
    python3 -m venv /work/venv-dictlearn
    /work/venv-dictlearn/bin/pip install -c constraints.txt torch==2.13.0
    /work/venv-dictlearn/bin/pip install -c constraints.txt dictionary-learning
    /work/venv-dictlearn/bin/pip uninstall -y torchvision   # it pulls one that does not load with torch 2.13.0+cpu

    .venv/bin/python bench/sae_trainers_bench.py all --saelens-python /work/venv-saelens/bin/python \\
        --dictlearn-python /work/venv-dictlearn/bin/python [--prompts 200] [--budget 240] [--threads 2]

Writes bench/results/sae_trainers.json and prints a table. The data and each trained SAE stay under
--work (default /tmp/sae-trainers-bench); a trainer whose directory is there already is not trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "sae_trainers.json"
LAYER = 10
HOOK = f"blocks.{LAYER}.hook_resid_post"
D_SAE, K, BATCH, SEED = 2304, 32, 256, 0
WARMUP_STEPS = 10


# --- the data (lmtrace's venv) ------------------------------------------------------------------------
def dump(data: Path, prompts: int, heldout: float) -> dict:
    """Activations at layer 10 resid_post of the first `prompts` documentation prompts -> data/*.npy."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from sae_text_prompts import chunks

    from lmtrace.analysis.features.activations import replay
    from lmtrace.capture.arch import adapter_for
    from lmtrace.commands.sae import split_sequences
    from lmtrace.features.sites import site_of
    from lmtrace.runner.models import load_model
    from lmtrace.spec.sections import ModelSpec

    t0 = time.time()
    loaded = load_model(ModelSpec(ref="embedded:smollm2-135m", device="cpu", dtype="float32"))
    tok, model = loaded.tokenizer, loaded.model
    adapter = adapter_for(model)
    site = site_of(LAYER, "resid_post")
    texts = [text for _, text in chunks(96)][:prompts]
    sequences = [list(tok(text)["input_ids"]) for text in texts]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    train_ids, held_ids = split_sequences(len(sequences), heldout, SEED)
    data.mkdir(parents=True, exist_ok=True)
    for name, ids in (("train", train_ids), ("heldout", held_ids)):
        rows = torch.cat(list(replay(model, adapter, site, [sequences[i] for i in ids], pad_id=pad_id)))
        np.save(data / f"{name}.npy", rows.numpy().astype(np.float32))
    meta = {
        "model": "embedded:smollm2-135m",
        "hook_name": HOOK,
        "text": "pydoc_data.topics, ~96-word chunks (scripts/sae_text_prompts.py), the first prompts",
        "prompts": len(sequences),
        "train_sequences": len(train_ids),
        "heldout_sequences": len(held_ids),
        "train_tokens": int(np.load(data / "train.npy", mmap_mode="r").shape[0]),
        "heldout_tokens": int(np.load(data / "heldout.npy", mmap_mode="r").shape[0]),
        "pad_id": pad_id,
        "seconds": round(time.time() - t0, 1),
    }
    (data / "heldout_sequences.json").write_text(json.dumps([sequences[i] for i in held_ids]))
    (data / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _rows(data: Path):
    import numpy as np

    return np.load(data / "train.npy", mmap_mode="r")


def _epochs_order(n: int, epoch: int):
    """The row order of an epoch: a permutation seeded by (SEED, epoch), the same in every venv."""
    import numpy as np

    return np.random.default_rng([SEED, epoch]).permutation(n)


def batches(data: Path):
    """Endless [BATCH, d] float32 torch batches of train.npy, epoch after epoch, each in a seeded order."""
    import numpy as np
    import torch

    rows = _rows(data)
    epoch = 0
    while True:
        order = _epochs_order(len(rows), epoch)
        for start in range(0, len(rows) - BATCH + 1, BATCH):
            yield torch.from_numpy(np.asarray(rows[np.sort(order[start : start + BATCH])], dtype=np.float32))
        epoch += 1


def timed_loop(step, budget: float, total_steps: int, data: Path) -> dict:
    """Call step(i, x) on successive batches until `budget` seconds or `total_steps` steps have passed."""
    t0 = time.time()
    steps = 0
    for x in batches(data):
        if steps >= total_steps or time.time() - t0 >= budget:
            break
        step(steps, x)
        steps += 1
    return {"steps": steps, "tokens_seen": steps * BATCH, "seconds": round(time.time() - t0, 1)}


def warmup_seconds_per_step(make_step, data: Path) -> float:
    """Seconds per step of a throwaway trainer over WARMUP_STEPS steps (after one untimed step)."""
    step = make_step(WARMUP_STEPS + 1)
    it = batches(data)
    step(0, next(it))
    t0 = time.time()
    for i in range(WARMUP_STEPS):
        step(i + 1, next(it))
    return (time.time() - t0) / WARMUP_STEPS


# --- lmtrace's trainer (lmtrace's venv) ---------------------------------------------------------------
class _Store:
    """train.npy as the ActivationStore train_sae reads (.n, .d, .data), `n` rows long: row i is train row
    i mod len(train), so one epoch over it is n / len(train) passes over the data."""

    def __init__(self, rows, n: int | None = None):
        self.rows, self.n, self.d = rows, n or rows.shape[0], rows.shape[1]
        self.data = self

    def __getitem__(self, idx):
        import numpy as np

        return np.asarray(self.rows[np.asarray(idx) % len(self.rows)])


def train_lmtrace(data: Path, out: Path, budget: float) -> dict:
    """lmtrace's train_sae with its defaults (lr 1e-3), batch 256, for the steps that fit `budget` at the step
    time of a warm-up; it cannot stop on time, so one epoch over train.npy repeated to that many rows."""
    from lmtrace.analysis.features.train import TrainSettings, train_sae
    from lmtrace.features.format import write_sae

    rows = _rows(data)
    settings = dict(d_sae=D_SAE, k=K, batch=BATCH, seed=SEED, epochs=1)
    probe = _Store(rows, (WARMUP_STEPS + 1) * BATCH)
    train_sae(probe, TrainSettings(**settings), HOOK)  # warm-up (untimed)
    t0 = time.time()
    train_sae(probe, TrainSettings(**settings), HOOK)
    per_step = (time.time() - t0) / (WARMUP_STEPS + 1)
    total = max(1, int(budget / per_step))
    sae, log = train_sae(_Store(rows, total * BATCH), TrainSettings(**settings), HOOK, model_name="smollm2-135m")
    write_sae(sae, out)
    return {**{k: log[k] for k in ("steps", "tokens_seen", "seconds", "lr")}, "planned_steps": total}


# --- the metrics (lmtrace's venv) ---------------------------------------------------------------------
def evaluate(data: Path, sae_dirs: dict[str, Path]) -> dict:
    """Each SAE directory read by lmtrace and measured by lmtrace's metrics on the held-out data."""
    import numpy as np
    import torch

    from lmtrace.analysis.features.metrics import ce_loss_recovered, reconstruction_metrics
    from lmtrace.capture.arch import adapter_for
    from lmtrace.features.format import read_sae
    from lmtrace.features.sites import site_of
    from lmtrace.runner.models import load_model
    from lmtrace.spec.sections import ModelSpec

    meta = json.loads((data / "meta.json").read_text())
    held = torch.from_numpy(np.load(data / "heldout.npy"))
    sequences = json.loads((data / "heldout_sequences.json").read_text())
    loaded = load_model(ModelSpec(ref="embedded:smollm2-135m", device="cpu", dtype="float32"))
    adapter = adapter_for(loaded.model)
    site = site_of(LAYER, "resid_post")
    out = {}
    for name, path in sae_dirs.items():
        sae = read_sae(path)
        recon = reconstruction_metrics(sae, held.split(1024))
        ce = ce_loss_recovered(loaded.model, adapter, sae, site, sequences, pad_id=meta["pad_id"])
        out[name] = {**recon, **{f"ce_{k}" if k == "tokens" else k: v for k, v in ce.items()}}
    return out


# --- SAELens's trainer (its venv) ---------------------------------------------------------------------
def train_saelens(data: Path, out: Path, budget: float) -> dict:
    """SAELens's TopKTrainingSAE and SAETrainer (its optimizer, schedule, auxiliary loss, dead-latent window and
    activation scaling `expected_average_only_in`, folded into the weights at the end, as its runner does), fed
    our batches instead of its HookedTransformer activation store; saved with its own save_inference_model."""
    import torch
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.training.sae_trainer import SAETrainer

    d = int(_rows(data).shape[1])

    def make(total_steps: int):
        torch.manual_seed(SEED)
        cfg = TopKTrainingSAEConfig(d_in=d, d_sae=D_SAE, k=K, normalize_activations="expected_average_only_in")
        cfg.metadata.hook_name = HOOK
        cfg.metadata.model_name = "smollm2-135m"
        trainer = SAETrainer(
            SAETrainerConfig(
                total_training_samples=total_steps * BATCH,
                train_batch_size_samples=BATCH,
                lr_end=SAETrainerConfig.lr / 10,  # what its runner config sets (lr_end None -> lr / 10)
            ),
            TopKTrainingSAE(cfg),
            batches(data),
        )
        trainer.activation_scaler.estimate_scaling_factor(
            d_in=d, data_provider=batches(data), n_batches_for_norm_estimate=64
        )

        def step(_i, x):
            trainer.maybe_reset_sparsity()
            trainer.step(x)
            trainer.n_training_steps += 1

        return trainer, step

    per_step = warmup_seconds_per_step(lambda n: make(n)[1], data)
    total = max(1, int(budget / per_step))
    trainer, step = make(total)
    log = timed_loop(step, budget, total, data)
    trainer.sae.fold_activation_norm_scaling_factor(trainer.activation_scaler.scaling_factor)
    trainer.activation_scaler.scaling_factor = None
    trainer.set_final_sae_metadata()
    trainer.sae.save_inference_model(out)
    return {**log, "planned_steps": total, "lr": trainer.cfg.lr}


# --- dictionary-learning's trainer (its venv) ---------------------------------------------------------
def train_dictlearn(data: Path, out: Path, budget: float) -> dict:
    """dictionary-learning's TopKTrainer (its learning rate for the width, auxiliary loss, geometric-median b_dec,
    gradient projection, inputs scaled to unit mean squared norm as trainSAE's normalize_activations does, the
    scale folded into the biases at the end as trainSAE does); its 1,000 warm-up steps shortened to a tenth of
    the planned steps when fewer are planned. Saved here in the SAELens format."""
    import numpy as np
    from dictionary_learning.trainers.top_k import TopKTrainer
    from safetensors.torch import save_file

    rows = _rows(data)
    d = int(rows.shape[1])
    sample = np.asarray(rows[: 64 * BATCH], dtype=np.float32)
    norm_factor = float(np.sqrt((sample**2).sum(-1).mean()))

    def make(total_steps: int):
        warmup = min(1000, max(1, total_steps // 10))
        trainer = TopKTrainer(
            steps=total_steps,
            activation_dim=d,
            dict_size=D_SAE,
            k=K,
            layer=LAYER,
            lm_name="smollm2-135m",
            warmup_steps=warmup,
            threshold_start_step=warmup,
            seed=SEED,
            device="cpu",
        )
        return trainer, lambda i, x: trainer.update(i, x / norm_factor)

    per_step = warmup_seconds_per_step(lambda n: make(n)[1], data)
    total = max(2, int(budget / per_step))
    trainer, step = make(total)
    log = timed_loop(step, budget, total, data)
    ae = trainer.ae
    ae.scale_biases(norm_factor)
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        "W_enc": ae.encoder.weight.detach().t(),
        "b_enc": ae.encoder.bias.detach(),
        "W_dec": ae.decoder.weight.detach().t(),
        "b_dec": ae.b_dec.detach(),
    }
    save_file({k: v.float().contiguous() for k, v in weights.items()}, str(out / "sae_weights.safetensors"))
    cfg = {
        "architecture": "topk",
        "d_in": d,
        "d_sae": D_SAE,
        "k": K,
        "dtype": "float32",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": HOOK, "model_name": "smollm2-135m", "converted_from": "dictionary-learning"},
    }
    (out / "cfg.json").write_text(json.dumps(cfg, indent=2))
    return {**log, "planned_steps": total, "lr": trainer.lr}


# --- driver -------------------------------------------------------------------------------------------
TRAINERS = {"lmtrace": train_lmtrace, "saelens": train_saelens, "dictlearn": train_dictlearn}


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def run_train(trainer: str, data: Path, out: Path, budget: float, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    load_before = _load()
    log = TRAINERS[trainer](data, out, budget)
    log.update(trainer=trainer, threads=threads, load_before=load_before, load_after=_load())
    (out / "bench_train.json").write_text(json.dumps(log, indent=2))
    return log


def run_all(args) -> dict:
    data, work = Path(args.data), Path(args.work)
    if not (data / "meta.json").is_file():
        print("dumping activations ...", flush=True)
        dump(data, args.prompts, 0.1)
    meta = json.loads((data / "meta.json").read_text())
    pythons = {"lmtrace": sys.executable, "saelens": args.saelens_python, "dictlearn": args.dictlearn_python}
    dirs, logs = {}, {}
    for name in args.trainers.split(","):
        out = work / name
        if not (out / "bench_train.json").is_file():
            print(f"training {name} for {args.budget:.0f} s ...", flush=True)
            cmd = [pythons[name], __file__, "train", "--trainer", name, "--data", str(data), "--out", str(out)]
            cmd += ["--budget", str(args.budget), "--threads", str(args.threads)]
            env = dict(
                os.environ,
                PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS=str(args.threads),
                WANDB_MODE="disabled",
                TQDM_DISABLE="1",
            )
            subprocess.run(cmd, check=True, env=env)
        dirs[name] = out
        logs[name] = json.loads((out / "bench_train.json").read_text())
    print("measuring ...", flush=True)
    metrics = evaluate(data, dirs)
    result = {"data": meta, "budget_s": args.budget, "trainers": {n: {**logs[n], **metrics[n]} for n in dirs}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    _print(result)
    return result


def _print(result: dict) -> None:
    head = ("trainer", "steps", "tokens", "train s", "expl var", "L0", "dead %", "CE sae", "loss rec", "load")
    print(" | ".join(head))
    for name, r in result["trainers"].items():
        print(
            f"{name} | {r['steps']} | {r['tokens_seen']} | {r['seconds']} | {r['explained_variance']:.3f} | "
            f"{r['mean_l0']:.1f} | {100 * r['dead_fraction']:.1f} | {r['ce_sae']:.3f} | {r['loss_recovered']:.3f} | "
            f"{r['load_before']} / {r['load_after']}"
        )
    r = next(iter(result["trainers"].values()))
    print(f"CE original {r['ce_orig']:.3f}, zero-ablated {r['ce_zero']:.3f} (nats, {r['ce_tokens']} tokens)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="dump (once), train each trainer in its venv, measure, write the results")
    a.add_argument("--saelens-python", default="/work/venv-saelens/bin/python")
    a.add_argument("--dictlearn-python", default="/work/venv-dictlearn/bin/python")
    a.add_argument("--trainers", default="lmtrace,saelens,dictlearn")
    a.add_argument("--work", default="/tmp/sae-trainers-bench")
    a.add_argument("--data", default="/tmp/sae-trainers-bench/data")
    a.add_argument("--prompts", type=int, default=200)
    a.add_argument("--budget", type=float, default=240.0)
    a.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train", help="train one trainer (run by the venv that has it)")
    t.add_argument("--trainer", choices=sorted(TRAINERS), required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--budget", type=float, default=240.0)
    t.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "train":
        print(json.dumps(run_train(args.trainer, Path(args.data), Path(args.out), args.budget, args.threads)))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
