"""Feature edits: change an SAE's latents at its hook and put the change back into the model's activation,
the SAE's reconstruction error kept.

With f = encode(x), f' = the edited latents and x̂(f) = decode(f), the edited activation is

    x' = x̂(f') + (x - x̂(f)) = x + x̂(f') - x̂(f)

so an edit that leaves f unchanged returns x itself, bit for bit (the unedited rows are not touched at
all), and the reconstruction error the SAE misses stays in the stream. Kinds:

  ablate  f'_F = 0
  clamp   f'_F = V
  steer   x' = x + C · W_dec[F]  (the decoder direction added with coefficient C, in the activation's own
          space, as Neuronpedia and SAELens steer; the latents are not re-encoded)

A transcoder (lmtrace/features/sae.py) reads its latents at its input site (the MLP's input) and writes
to its output site (the MLP's output): there the edited output is

    out' = out + x̂(f') − x̂(f)        (steer: out + C · W_dec[F])

with out the MLP's own output, f = encode(MLP input): the MLP's output kept, plus the change the edit
makes to the transcoder's output (its skip term, if any, cancels).

Text forms (`intervene --feature-ablate SAE:F`, `--feature-clamp SAE:F=V`, `--feature-steer SAE:F*C`):
SAE is a directory or a run's short name for one; the last ':' separates it from the feature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..exits.errors import SpecError
from .sae import Sae

EDIT_KINDS = ("ablate", "clamp", "steer")


@dataclass(frozen=True)
class FeatureEdit:
    kind: str  # one of EDIT_KINDS
    feature: int
    value: float = 0.0  # clamp: the value; steer: the coefficient; ablate: unused

    def describe(self) -> str:
        if self.kind == "ablate":
            return f"ablate {self.feature}"
        if self.kind == "clamp":
            return f"clamp {self.feature}={self.value:g}"
        return f"steer {self.feature}*{self.value:g}"


def parse_feature_edit(kind: str, text: str) -> tuple[str, FeatureEdit]:
    """'SAE:F' / 'SAE:F=V' / 'SAE:F*C' -> (SAE reference, FeatureEdit); SpecError naming the form otherwise."""
    forms = {"ablate": "SAE:F", "clamp": "SAE:F=V", "steer": "SAE:F*C"}
    if kind not in forms:
        raise SpecError(f"unknown feature edit {kind!r}; use one of {', '.join(EDIT_KINDS)}")
    form = forms[kind]
    sae_ref, sep, rest = text.rpartition(":")
    if not sep or not sae_ref:
        raise SpecError(f"feature {kind} {text!r}: write it as {form} (an SAE directory or name, ':', a feature id)")
    op = {"ablate": None, "clamp": "=", "steer": "*"}[kind]
    value = 0.0
    feature_text = rest
    if op is not None:
        feature_text, found, value_text = rest.partition(op)
        if not found:
            raise SpecError(f"feature {kind} {text!r}: write it as {form}")
        try:
            value = float(value_text)
        except ValueError:
            raise SpecError(f"feature {kind} {text!r}: {value_text!r} is not a number; write it as {form}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise SpecError(f"feature {kind} {text!r}: the value must be finite")
    try:
        feature = int(feature_text)
    except ValueError:
        raise SpecError(f"feature {kind} {text!r}: {feature_text!r} is not a feature id; write it as {form}") from None
    if feature < 0:
        raise SpecError(f"feature {kind} {text!r}: feature ids start at 0")
    return sae_ref, FeatureEdit(kind, feature, value)


def check_features(sae: Sae, edits: list[FeatureEdit], name: str) -> None:
    """SpecError when an edit names a feature the SAE does not have."""
    for e in edits:
        if e.feature >= sae.cfg.d_sae:
            raise SpecError(
                f"feature {e.feature} is out of range for SAE {name} ({sae.cfg.d_sae} latents: 0..{sae.cfg.d_sae - 1})"
            )


def apply_feature_edits(
    x: torch.Tensor, sae: Sae, edits: list[FeatureEdit], out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., d_in] -> the edited activation [..., d_in] in x's dtype (the formula in the module's docstring).

    A transcoder reads x (its input site) and writes `out` [..., d_out] (the output site's own value,
    required): the result is out + decode(f') − decode(f) (steer: out + C · W_dec[F]) in out's dtype.
    Every row is edited; callers select rows and positions before calling.
    """
    if sae.cfg.transcoder and out is None:
        raise ValueError("a transcoder's feature edit needs the output site's value (out)")
    base = x if out is None else out
    if not edits:
        return base
    y = base.float()
    latent_edits = [e for e in edits if e.kind in ("ablate", "clamp")]
    if latent_edits:
        acts, norm = sae.encode_with_norm(x.float())
        edited = acts.clone()
        for e in latent_edits:
            edited[..., e.feature] = 0.0 if e.kind == "ablate" else e.value
        y = y + (sae.decode(edited, norm) - sae.decode(acts, norm))
    for e in edits:
        if e.kind == "steer":
            y = y + e.value * sae.W_dec[e.feature]
    return y.to(base.dtype)


def latent_delta(sae: Sae, feature: int, change: torch.Tensor, norm=None) -> torch.Tensor:
    """decode(f') − decode(f) where f' is f with latent `feature` changed by `change` [...] (float32):
    the change's decoder direction, `change[..., None] · W_dec[feature]`, through the SAE's output
    de-normalisation (`norm` from `Sae.encode_with_norm`; its shift cancels). [..., d_in] float32."""
    return sae.rescale_out(change.float()[..., None] * sae.W_dec[feature], norm)


def set_latent(x: torch.Tensor, sae: Sae, feature: int, target: torch.Tensor) -> torch.Tensor:
    """x [..., d_in] with latent `feature` set to `target` [...] (one value per row: a patch from another
    run's latents), the reconstruction error kept: x + decode(f') − decode(f). In x's dtype."""
    acts, norm = sae.encode_with_norm(x.float())
    return (x.float() + latent_delta(sae, feature, target.float() - acts[..., feature], norm)).to(x.dtype)
