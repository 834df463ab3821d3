"""The `intervene` command line's shorthand flags (`--ablate-head 12.3:mean`, `--mask-positions 3-9`, ...)
turned into the entry dicts `entries.parse_entries` reads."""

from __future__ import annotations

from ...exits.errors import SpecError
from ...features.edits import parse_feature_edit
from ...spec.steps import parse_range_list
from .entries import SPANS


def _split_mode(item, flag: str, example: str) -> tuple[str, str]:
    """'7' -> ('7', 'zero'); '7:mean' -> ('7', 'mean'); a trailing ':zero' is accepted too."""
    text = str(item).strip()
    for mode in ("mean", "zero"):
        if text.endswith(":" + mode):
            return text[: -len(mode) - 1], mode
    if ":" in text and text.rsplit(":", 1)[-1].isalpha():
        raise SpecError(f"{flag} {text!r}: the ablation mode after ':' is zero or mean, e.g. {example}")
    return text, "zero"


def shorthand_entries(
    ablate_head: list[str],
    ablate_layer: list,
    ablate_mlp: list,
    ablate_attn: list,
    ablate_neurons: list[str],
    mask_positions: list[str],
    feature_ablate: list[str] = (),
    feature_clamp: list[str] = (),
    feature_steer: list[str] = (),
) -> list[dict]:
    """Turn the CLI's shorthand flags into entry dicts.

    Every ablation flag takes an optional `:mean` suffix (default zero): `--ablate-head 12.3:mean`,
    `--ablate-layer 7:mean`, `--ablate-mlp 7:mean`, `--ablate-attn 4:mean`, `--ablate-neurons 7:120,455:mean`.
    `--mask-positions` takes positions and ranges (`3-9`, `1,4`) or a span name (prompt, generated,
    system, user). `--feature-ablate SAE:F`, `--feature-clamp SAE:F=V` and `--feature-steer SAE:F*C` edit
    feature F of an SAE (a directory, or the short name of one the parent recorded).
    """
    out: list[dict] = []
    for item in ablate_head:
        text, mode = _split_mode(item, "--ablate-head", "12.3:mean")
        try:
            layer, head = (int(x) for x in text.split("."))
        except ValueError:
            raise SpecError(f"--ablate-head {item!r}: expected LAYER.HEAD[:mean], e.g. 12.3 or 12.3:mean") from None
        out.append({"kind": "ablate_head", "layer": layer, "head": head, "mode": mode})
    for flag, kind, items in (
        ("--ablate-layer", "ablate_layer", ablate_layer),
        ("--ablate-mlp", "ablate_mlp", ablate_mlp),
        ("--ablate-attn", "ablate_attention", ablate_attn),
    ):
        for item in items:
            text, mode = _split_mode(item, flag, "7:mean")
            try:
                out.append({"kind": kind, "layer": int(text), "mode": mode})
            except ValueError:
                raise SpecError(f"{flag} {item!r}: expected LAYER[:mean], e.g. 7 or 7:mean") from None
    for item in ablate_neurons:
        text, mode = _split_mode(item, "--ablate-neurons", "7:120,455:mean")
        if ":" not in text:
            raise SpecError(f"--ablate-neurons {item!r}: expected LAYER:N1,N2,...[:mean], e.g. 7:120,455")
        layer, neurons = text.split(":", 1)
        try:
            out.append(
                {
                    "kind": "ablate_neurons",
                    "layer": int(layer),
                    "neurons": parse_range_list(neurons, "--ablate-neurons"),
                    "mode": mode,
                }
            )
        except ValueError:
            raise SpecError(f"--ablate-neurons {item!r}: LAYER must be an integer") from None
    for item in mask_positions:
        if item.strip() in SPANS:
            out.append({"kind": "mask_positions", "span": item.strip()})
        else:
            out.append({"kind": "mask_positions", "mask": parse_range_list(item, "--mask-positions")})
    return out + _feature_entries(feature_ablate, feature_clamp, feature_steer)


def _feature_entries(ablate: list[str], clamp: list[str], steer: list[str]) -> list[dict]:
    """--feature-ablate SAE:F, --feature-clamp SAE:F=V, --feature-steer SAE:F*C -> entry dicts."""
    out = []
    for kind, items in (("ablate", ablate), ("clamp", clamp), ("steer", steer)):
        for item in items:
            sae, edit = parse_feature_edit(kind, str(item).strip())
            entry = {"kind": f"{kind}_feature", "sae": sae, "feature": edit.feature}
            if kind != "ablate":
                entry["value" if kind == "clamp" else "coefficient"] = edit.value
            out.append(entry)
    return out
