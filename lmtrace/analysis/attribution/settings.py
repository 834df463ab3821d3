"""The settings of one `lmtrace explain` invocation (target, baselines, the IG rule and budget, kept and
excluded positions), checked before any work; recorded per method in the manifest."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...exits.errors import SpecError

TARGETS = ("chosen", "runner-up", "contrast")
QUANTITIES = ("logit", "logprob")
BASELINES = ("mean", "scaled-mean", "pad", "zero")
IG_RULES = ("adaptive", "midpoint")
IG_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class Settings:
    target: str = "chosen"
    quantity: str = "logit"
    baseline: str = "mean"
    ig_steps: int = 16
    ig_rule: str = "adaptive"
    batch_size: int = 8
    ig_tolerance: float = 0.01
    ig_max_points: int = 1024
    ig_keep: str = "sink"  # integrated gradients: positions whose baseline is their own embedding ("none", "sink",
    #                        "special" = position 0 and every special token of the context, "0,3", or a mix)
    ig_dtype: str = "float32"  # integrated gradients: precision of the path's forwards and gradients
    rollout_exclude: str = ""  # attention rollout: "sink" (position 0) or positions "0,3" left out
    sae_top: int = 16  # attribution to SAE latents (--sae): latents kept per position, by |attribution|

    @property
    def rollout_excluded(self) -> tuple[int, ...]:
        """Key positions attention rollout leaves out (`--rollout-exclude`): sink = position 0."""
        return _positions(self.rollout_exclude, "--rollout-exclude")

    @property
    def ig_kept(self) -> tuple[int, ...]:
        """Positions integrated gradients keeps at their own embedding in the baseline (`--ig-keep`), besides the
        special tokens that `special` adds per context (`ig_keep_special`)."""
        if str(self.ig_keep).strip() == "none":
            return ()
        return _positions(self.ig_keep, "--ig-keep", words={"special": (0,)})

    @property
    def ig_keep_special(self) -> bool:
        """`--ig-keep special`: also keep every position whose token is one of the tokenizer's special tokens."""
        return "special" in str(self.ig_keep).replace(" ", "").split(",")

    def check(self) -> "Settings":
        if self.ig_rule == "trapezoid":
            raise SpecError(
                "--ig-rule trapezoid: removed, it evaluates the gradient at the baseline (α = 0), where "
                "RMSNorm/LayerNorm models are singular for the zero baseline; use adaptive (default) or midpoint"
            )
        self.rollout_excluded  # noqa: B018 (refuses a bad --rollout-exclude before anything runs)
        self.ig_kept  # noqa: B018
        for name, value, allowed in (
            ("--target", self.target, TARGETS),
            ("--quantity", self.quantity, QUANTITIES),
            ("--baseline", self.baseline, BASELINES),
            ("--ig-rule", self.ig_rule, IG_RULES),
            ("--ig-dtype", self.ig_dtype, IG_DTYPES),
        ):
            if value not in allowed:
                raise SpecError(f"{name} {value!r}: expected one of {', '.join(allowed)}")
        if self.ig_steps < 1:
            raise SpecError(f"--ig-steps {self.ig_steps}: must be at least 1")
        if self.batch_size < 1:
            raise SpecError(f"--batch-size {self.batch_size}: must be at least 1")
        if not (math.isfinite(self.ig_tolerance) and 0 < self.ig_tolerance < 1):
            raise SpecError(f"--ig-tolerance {self.ig_tolerance}: must be a fraction between 0 and 1 (e.g. 0.01 = 1 %)")
        if self.sae_top < 1:
            raise SpecError(f"--sae-top {self.sae_top}: must be at least 1")
        if self.ig_max_points < 4:
            raise SpecError(f"--ig-max-points {self.ig_max_points}: must be at least 4")
        return self

    def check_positions(self, longest: int, last_step: int, methods: list[str]) -> None:
        """Refuse `--ig-keep` / `--rollout-exclude` positions outside every explained context (the longest, at
        step `last_step`, has positions 0..longest−1) for the methods that use them, before any work."""
        for option, text, positions, method in (
            ("--ig-keep", self.ig_keep, self.ig_kept, "integrated_gradients"),
            ("--rollout-exclude", self.rollout_exclude, self.rollout_excluded, "attention_rollout"),
        ):
            outside = [p for p in positions if p >= longest]
            if method in methods and outside:
                which = (
                    f"position {outside[0]} is"
                    if len(outside) == 1
                    else f"positions {', '.join(map(str, outside))} are"
                )
                raise SpecError(
                    f"{option} {text!r}: {which} outside every "
                    f"explained context (step {last_step}'s context has positions 0..{longest - 1}); "
                    f"give positions below {longest}"
                )


def _positions(text: str, option: str, words: dict[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """'sink' (= position 0) and/or positions like '0,3' (and the option's own `words`) -> sorted unique positions."""
    words = {"sink": (0,), **(words or {})}
    out = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if part in words:
            out.update(words[part])
            continue
        try:
            value = int(part)
        except ValueError:
            value = -1
        if value < 0:
            raise SpecError(f"{option} {text!r}: expected {' or '.join(f'`{w}`' for w in words)} or positions like 0,3")
        out.add(value)
    return tuple(sorted(out))
