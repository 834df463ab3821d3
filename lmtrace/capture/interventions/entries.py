"""The interventions a user writes: typed entries (which component, where, when), parsed and checked
against a model's and a run's sizes. Each kind is described in the package's docstring
(`lmtrace/capture/interventions/__init__.py`)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from ...exits.errors import SpecError
from ...features.edits import FeatureEdit


class EntryBase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sequences: Literal["all"] | list[int] = "all"
    steps: Literal["all"] | list[int] | dict[Literal["from"], int] = "all"
    positions: Literal["all"] | list[int] = "all"

    def active_at(self, step: int) -> bool:
        if self.steps == "all":
            return True
        if isinstance(self.steps, dict):
            return step >= self.steps["from"]
        return step in self.steps

    def first_step(self) -> int:
        if self.steps == "all":
            return 0
        if isinstance(self.steps, dict):
            return self.steps["from"]
        return min(self.steps) if self.steps else 10**9


class Ablation(EntryBase):
    mode: Literal["zero", "mean"] = "zero"


class AblateHead(Ablation):
    kind: Literal["ablate_head"]
    layer: int
    head: int


class AblateAttention(Ablation):
    kind: Literal["ablate_attention"]
    layer: int


class AblateMlp(Ablation):
    kind: Literal["ablate_mlp"]
    layer: int


class AblateNeurons(Ablation):
    kind: Literal["ablate_neurons"]
    layer: int
    neurons: list[int] = Field(min_length=1)


class AblateLayer(Ablation):
    kind: Literal["ablate_layer"]
    layer: int


SPANS = ("prompt", "generated", "system", "user")
CHAT_SPANS = ("system", "user")


class MaskPositions(EntryBase):
    kind: Literal["mask_positions"]
    mask: list[int] | None = None  # token positions to hide
    span: Literal["prompt", "generated", "system", "user"] | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.mask is None) == (self.span is None):
            raise ValueError(
                "mask_positions needs exactly one of `mask` (positions) or `span` (prompt|generated|system|user)"
            )
        return self


class PatchResidual(EntryBase):
    kind: Literal["patch_residual"]
    layer: int
    source_run: str
    source_sequence: int | None = None  # default: the same sequence index


class PatchHead(EntryBase):
    kind: Literal["patch_head"]
    layer: int
    head: int
    source_run: str
    source_sequence: int | None = None  # default: the same sequence index


class MaskExperts(EntryBase):
    kind: Literal["mask_experts"]
    layer: int
    experts: list[int] = Field(min_length=1)


class Steer(EntryBase):
    kind: Literal["steer"]
    layer: int
    alpha: float
    vector: str | None = None  # .npy file with d_model values
    from_runs: list[str] | None = None  # [A, B]: mean residual at `layer` of run A minus run B

    @model_validator(mode="after")
    def _one(self):
        if (self.vector is None) == (self.from_runs is None):
            raise ValueError("steer needs exactly one of `vector` (.npy file) or `from_runs` ([run_a, run_b])")
        if self.from_runs is not None and len(self.from_runs) != 2:
            raise ValueError("steer.from_runs takes two runs: [A, B] (the direction is mean(A) - mean(B))")
        return self


class FeatureEntry(EntryBase):
    """A feature edit at an SAE's hook (`lmtrace/features/edits.py`: the reconstruction error kept).

    `sae` is a SAELens directory or the short name of an SAE the parent recorded (manifest `features`);
    the child records the directory it resolved to and the sha256 of its weights (`sae_sha256`), and a
    recorded checksum is checked again when the entry is replayed (a resumed child)."""

    sae: str = Field(min_length=1)
    feature: int = Field(ge=0)
    sae_sha256: str | None = None

    def feature_edit(self) -> FeatureEdit:
        kind = self.kind.removesuffix("_feature")
        return FeatureEdit(kind, self.feature, getattr(self, "value", getattr(self, "coefficient", 0.0)))


class AblateFeature(FeatureEntry):
    kind: Literal["ablate_feature"]


class ClampFeature(FeatureEntry):
    kind: Literal["clamp_feature"]
    value: float = Field(allow_inf_nan=False)


class SteerFeature(FeatureEntry):
    kind: Literal["steer_feature"]
    coefficient: float = Field(allow_inf_nan=False)  # the decoder direction W_dec[feature] times this is added


Entry = Annotated[
    Union[
        AblateHead,
        AblateAttention,
        AblateMlp,
        AblateNeurons,
        AblateLayer,
        MaskPositions,
        PatchResidual,
        PatchHead,
        Steer,
        MaskExperts,
        AblateFeature,
        ClampFeature,
        SteerFeature,
    ],
    Field(discriminator="kind"),
]
KINDS = (
    "ablate_head",
    "ablate_attention",
    "ablate_mlp",
    "ablate_neurons",
    "ablate_layer",
    "mask_positions",
    "patch_residual",
    "patch_head",
    "steer",
    "mask_experts",
    "ablate_feature",
    "clamp_feature",
    "steer_feature",
)
_ENTRIES = TypeAdapter(list[Entry])


def parse_entries(data, source: str) -> list[EntryBase]:
    try:
        return _ENTRIES.validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"{source}: interventions.{loc}: {first['msg']} (kinds: {', '.join(KINDS)})") from None


def validate_against(
    entries: list[EntryBase],
    n_layers: int,
    n_heads: int,
    d_ffn: int,
    n_sequences: int,
    n_experts: int | None = None,
    experts_per_token: int | None = None,
    model_class: str = "this model",
) -> None:
    """Out-of-range layers, heads, neurons, experts or sequences are errors naming the valid range."""
    for i, e in enumerate(entries):
        where = f"interventions[{i}] ({e.kind})"
        layer = getattr(e, "layer", None)
        if layer is not None and not 0 <= layer < n_layers:
            raise SpecError(f"{where}: layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        if isinstance(e, (AblateHead, PatchHead)) and not 0 <= e.head < n_heads:
            raise SpecError(f"{where}: head {e.head} is out of range: the model has heads 0..{n_heads - 1}")
        if isinstance(e, AblateNeurons):
            bad = [n for n in e.neurons if not 0 <= n < d_ffn]
            if bad:
                raise SpecError(f"{where}: neurons {bad[:5]} out of range: the MLP has neurons 0..{d_ffn - 1}")
        if isinstance(e, MaskExperts):
            if not n_experts:
                raise SpecError(
                    f"{where}: {model_class} has no mixture-of-experts router; expert masking needs a "
                    f"MoE model (mixtral, qwen2_moe, gpt_oss)"
                )
            bad = [x for x in e.experts if not 0 <= x < n_experts]
            if bad:
                raise SpecError(f"{where}: experts {bad[:5]} out of range: the model has experts 0..{n_experts - 1}")
            left = n_experts - len(set(e.experts))
            if experts_per_token and left < experts_per_token:
                raise SpecError(
                    f"{where}: masking {len(set(e.experts))} of {n_experts} experts leaves {left}, fewer "
                    f"than the {experts_per_token} the router picks per token; mask at most "
                    f"{n_experts - experts_per_token}"
                )
        if e.sequences != "all":
            bad = [s for s in e.sequences if not 0 <= s < n_sequences]
            if bad:
                raise SpecError(f"{where}: sequences {bad} out of range: the run has sequences 0..{n_sequences - 1}")
