"""A small run with an SAE's feature arrays, for the views' feature tests (serve, report): the tiny Llama,
three prompts, 8 generated tokens each, a random SAE at blocks.1.hook_resid_post archived inline
(`capture.features`), and one latent's logit effects computed by `lmtrace features --feature` (kept in
the run for the views); plus the test's own reads of the arrays and its own logit effects."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import random_sae

SAE_NAME, D_SAE, TOP_K = "resid-sae", 48, 5


def feature_run(base: Path, model_dir: Path, run_id: str = "feat") -> dict:
    """{run, runs, sae, cfg, w, feature (the most often active latent, its logit effects kept)}."""
    from lmtrace.commands.feature_find import features_find_command

    cfg, w = random_sae(base / SAE_NAME, "blocks.1.hook_resid_post", 64, D_SAE, seed=3, scale=3.0)
    run = run_spec(
        base,
        {
            "model": str(model_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 8, "batch_size": 3},
            "capture": {"features": [{"sae": str(base / SAE_NAME), "top_k": TOP_K}]},
            "output": {"run_id": run_id},
        },
    )
    idx, val = arrays(run.path)
    feature = int(np.bincount(idx[idx >= 0]).argmax())
    features_find_command(str(run.path), SAE_NAME, feature=feature, by=None, top=3, n_tokens=5, json_out=True)
    return {"run": run, "runs": base / "runs", "sae": base / SAE_NAME, "cfg": cfg, "w": w, "feature": feature}


def arrays(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """feat_<sae>_idx, _val read with zarr directly."""
    import zarr

    store = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    return np.asarray(store[f"feat_{SAE_NAME}_idx"][:]), np.asarray(store[f"feat_{SAE_NAME}_val"][:])


def own_logit_effects(model_dir: Path, w_dec_row: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The test's own: lm_head · (W_dec[F] × the final RMSNorm's weight), float64: (effects, order largest first)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    effects = model.lm_head.weight.detach().double().numpy() @ (
        w_dec_row.astype(np.float64) * model.model.norm.weight.detach().double().numpy()
    )
    return effects, np.argsort(-effects)[:n]
