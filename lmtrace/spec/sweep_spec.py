"""The sweep spec: the same object from `lmtrace sweep` flags or from a YAML file.

It lives next to the run spec (`run_spec.py`) rather than in `analysis/sweep/`: it is the command's
input, read from a path and validated by pydantic into one-line `SpecError`s, and the analysis
layer takes no paths. The analysis functions take its fields (`over`, `edit`, `positions`, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..exits.errors import SpecError

DEFAULT_METRICS = ("logprob", "prob", "kl", "rank")


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    over: str  # heads | attn | mlp | layers | neurons:L | positions | resid:A-B | features
    edit: Literal["zero", "mean", "patch", "clamp"] = "zero"  # clamp: --over features only
    source: str | None = None  # patch: the source run
    pair_by: str | None = (
        None  # patch: pair sequences by this id column of both runs' sequences.parquet (else by index)
    )
    metrics: list[str] = Field(default_factory=lambda: list(DEFAULT_METRICS))
    steps: str = "all"
    sequences: str = "all"
    positions: str | None = None  # None: every position at once (resid/positions: every prompt position, one by one)
    batch: int = Field(32, ge=1)
    # edits apply from this step on (intervene's --from-step): the unedited prefix is computed once per sequence
    from_step: int | None = Field(None, ge=0)
    # exact: every cell patched; attribution: every cell estimated from one forward and backward per sequence
    method: Literal["exact", "attribution"] = "exact"
    verify: int | None = Field(None, ge=1)  # attribution: patch the estimate's top N cells exactly
    graddrop: bool = False  # attribution: AtP*'s GradDrop (one more backward per layer)
    # --over features: the SAE (a SAELens directory or the run's short name for one), the swept features
    # (an explicit list, or the top N active ones at the measured steps), and --edit clamp's value
    sae: str | None = None
    features: str | list[int] | None = None  # "12,40,7" / "0-9", or a YAML list
    top_features: int | None = Field(None, ge=1)
    value: float | None = None

    def given(self) -> dict:
        """The spec as plan.json and sweep.json record it; the feature keys only where set (the files of a
        sweep of another kind are unchanged by them)."""
        data = self.model_dump(mode="json")
        for key in FEATURE_KEYS:
            if data[key] is None:
                del data[key]
        return data


FEATURE_KEYS = ("sae", "features", "top_features", "value")


def load_sweep_spec(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: sweep spec not found") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: malformed YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SpecError(
            f"{path}: expected a mapping (over, edit, source, pair_by, metrics, steps, sequences, positions, batch, "
            f"from_step, method, verify, graddrop, sae, features, top_features, value)"
        )
    return data


def build_sweep_spec(data: dict, where: str) -> SweepSpec:
    try:
        return SweepSpec(**data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"{where}: {loc}: {first['msg']}") from None
