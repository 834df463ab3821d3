"""The SAELens directory format: `cfg.json` + `sae_weights.safetensors`.

Read: SAELens 6 configs (`architecture`, `d_in`, `d_sae`, `k`, `apply_b_dec_to_input`,
`normalize_activations`, `metadata.hook_name`) and the older flat ones (`hook_name` / `hook_point` at
the top, `activation_fn_str` / `activation_fn` "topk" with `activation_fn_kwargs.k`, a boolean
`normalize_activations`), with the defaults SAELens gives missing keys (standard, b_dec applied to the
input, no normalisation). Weights: W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in],
threshold [d_sae] (JumpReLU; `log_threshold` is read as exp of it); a TopK SAE saved with
`rescale_acts_by_decoder_norm` has its decoder row norms folded into the weights as it is read. Everything
is checked before use: a missing directory or file, unreadable JSON, an unknown architecture or
normalisation, a missing or misshapen tensor, NaN or infinite weights each stop with one line (exit 2).

Transcoders (`architecture` transcoder, skip_transcoder, jumprelu_transcoder, jumprelu_skip_transcoder) are
read the same way, plus `d_out` and the output hook point (`metadata.hook_name_out` or `hook_name_out`);
W_dec [d_sae, d_out], b_dec [d_out], W_skip [d_out, d_in] (skip transcoders). Refused in one line: a
missing d_out or output hook, a hook pair lmtrace cannot serve (`sites.transcoder_sites`),
apply_b_dec_to_input true (SAELens refuses it too: b_dec is d_out wide), and an input normalisation that
decode would have to undo (constant_norm_rescale, layer_norm: SAELens normalises a transcoder's input
but never undoes it on the output, which then is not in the model's units).

Write: the SAELens 6 layout (what `SAE.load_from_disk` reads), weights in float32, plus any extra
files given (lmtrace's training card).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..exits.errors import SpecError
from .sae import ARCHITECTURES, NORMALISATIONS, TRANSCODERS, Sae, SaeConfig
from .sites import parse_hook_name, transcoder_sites

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
SAE_LENS_FORMAT_VERSION = "6.0.0"  # the cfg.json layout written (SAELens reads older layouts by version)


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t. A NaN or an infinity makes the sum non-finite, so a finite sum settles
    it in one pass without a mask the tensor's size (~10× faster on a 16k-latent encoder); only a sum
    that overflowed is checked element by element."""
    t = t.float()
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _fail(path: Path, text: str) -> SpecError:
    return SpecError(f"SAE {path}: {text}")


def _config(path: Path, raw: dict) -> SaeConfig:
    meta = dict(raw.get("metadata") or raw.get("meta") or {})
    hook = meta.get("hook_name") or raw.get("hook_name") or raw.get("hook_point")
    if not hook:
        raise _fail(path, f"{CFG} names no hook point (metadata.hook_name or hook_name)")
    head = meta.get("hook_head_index", raw.get("hook_head_index", raw.get("hook_point_head_index")))
    if head is not None:
        raise _fail(
            path,
            f"an SAE on one attention head (hook_head_index {head}) is not supported; "
            f"supported: SAEs on a whole hook point",
        )
    arch = raw.get("architecture", "standard")
    act = raw.get("activation_fn") or raw.get("activation_fn_str") or "relu"
    k = raw.get("k", (raw.get("activation_fn_kwargs") or {}).get("k"))
    if arch in TRANSCODERS:
        return _transcoder_config(path, raw, meta, arch, hook)
    if arch == "standard" and act == "topk":
        arch = "topk"
    elif arch == "standard" and act != "relu":
        raise _fail(path, f"activation function {act!r} is not supported; supported: relu, topk")
    if arch == "batchtopk":
        raise _fail(
            path,
            "a BatchTopK SAE saved for training has no inference threshold; save it for inference "
            "(SAELens: save_inference_model), which makes it a jumprelu SAE",
        )
    if arch not in ARCHITECTURES:
        raise _fail(
            path,
            f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES + TRANSCODERS)} "
            f"(BatchTopK as saved for inference is jumprelu)",
        )
    norm = raw.get("normalize_activations", "none")
    if isinstance(norm, bool):  # old configs: true meant expected_average_only_in
        norm = "expected_average_only_in" if norm else "none"
    if norm not in NORMALISATIONS:
        raise _fail(path, f"normalize_activations {norm!r} is not supported; supported: {', '.join(NORMALISATIONS)}")
    if raw.get("reshape_activations", "none") not in ("none", "hook_z"):
        raise _fail(
            path, f"reshape_activations {raw.get('reshape_activations')!r} is not supported; supported: none, hook_z"
        )
    d_in, d_sae = _sizes(path, raw, ("d_in", "d_sae"))
    if arch == "topk":
        if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= d_sae:
            raise _fail(path, f"a topk SAE needs k, a whole number in 1..d_sae ({d_sae}); got {k!r}")
    else:
        k = None
    parse_hook_name(hook, f"SAE {path}")  # refuse an unsupported hook point now, in one line
    meta.pop("hook_name", None)
    return SaeConfig(
        architecture=arch,
        d_in=d_in,
        d_sae=d_sae,
        hook_name=hook,
        k=k,
        apply_b_dec_to_input=bool(raw.get("apply_b_dec_to_input", True)),
        normalize_activations=norm,
        dtype=str(raw.get("dtype", "float32")),
        model_name=meta.pop("model_name", raw.get("model_name")),
        metadata=meta,
    )


def _sizes(path: Path, raw: dict, names: tuple[str, ...]) -> tuple[int, ...]:
    try:
        out = tuple(int(raw[n]) for n in names)
    except (KeyError, TypeError, ValueError):
        raise _fail(path, f"{CFG} needs whole numbers {' and '.join(names)}") from None
    if any(v <= 0 for v in out):
        raise _fail(path, f"{CFG}: {' and '.join(names)} must be positive")
    return out


def _transcoder_config(path: Path, raw: dict, meta: dict, arch: str, hook: str) -> SaeConfig:
    """A transcoder's cfg.json -> SaeConfig (the module docstring's checks, one line each)."""
    hook_out = meta.get("hook_name_out") or raw.get("hook_name_out")
    if not hook_out:
        raise _fail(path, f"a {arch} needs its output hook point in {CFG} (metadata.hook_name_out or hook_name_out)")
    if raw.get("apply_b_dec_to_input") is True:
        raise _fail(
            path,
            "apply_b_dec_to_input is true, which a transcoder cannot apply (b_dec is d_out wide; SAELens "
            "refuses it too); set it to false",
        )
    norm = raw.get("normalize_activations", "none")
    if isinstance(norm, bool):
        norm = "expected_average_only_in" if norm else "none"
    if norm not in ("none", "expected_average_only_in"):
        raise _fail(
            path,
            f"normalize_activations {norm!r} is not supported for a transcoder (SAELens normalises its input "
            f"and never undoes it on the output); supported: none, expected_average_only_in",
        )
    d_in, d_sae, d_out = _sizes(path, raw, ("d_in", "d_sae", "d_out"))
    transcoder_sites(hook, hook_out, f"SAE {path}")  # refuse a pair lmtrace cannot serve now, in one line
    for key in ("hook_name", "hook_name_out"):
        meta.pop(key, None)
    return SaeConfig(
        architecture=arch,
        d_in=d_in,
        d_sae=d_sae,
        hook_name=hook,
        apply_b_dec_to_input=False,
        normalize_activations=norm,
        dtype=str(raw.get("dtype", "float32")),
        model_name=meta.pop("model_name", raw.get("model_name")),
        metadata=meta,
        d_out=d_out,
        hook_name_out=hook_out,
    )


def _expected(cfg: SaeConfig) -> dict[str, tuple[int, ...]]:
    """The tensors an SAE directory must hold, and their shapes."""
    out_w = cfg.width_out
    expected = {"W_enc": (cfg.d_in, cfg.d_sae), "b_enc": (cfg.d_sae,), "W_dec": (cfg.d_sae, out_w), "b_dec": (out_w,)}
    if cfg.activation == "jumprelu":
        expected["threshold"] = (cfg.d_sae,)
    if cfg.skip:
        expected["W_skip"] = (out_w, cfg.d_in)
    return expected


def _release_hint(path: Path) -> str:
    """For a missing path written as SAELens's `release:sae_id`: how to make it a directory (lmtrace does not
    download SAEs)."""
    head, colon, sae_id = str(path).partition(":")
    release = head.rsplit("/", 1)[-1]  # a command-line path arrives made absolute
    if not colon or not release or not sae_id:
        return ""
    return (
        f"; SAELens releases are not downloaded by lmtrace: save this one to a directory where the network is, "
        f"python -c \"from sae_lens import SAE; SAE.from_pretrained('{release}', '{sae_id}').save_model('DIR')\", "
        f"and pass DIR"
    )


def read_sae(path: str | Path, device: str | torch.device = "cpu") -> Sae:
    """An SAE directory -> Sae (float32, on `device`); bad input raises SpecError (one line, exit 2)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise _fail(
            path,
            "no such directory (an SAE is a directory holding cfg.json and sae_weights.safetensors)"
            + _release_hint(path),
        )
    for name in (CFG, WEIGHTS):
        if not (path / name).is_file():
            raise _fail(path, f"{name} is missing (an SAE directory holds {CFG} and {WEIGHTS})")
    try:
        raw = json.loads((path / CFG).read_text())
    except (OSError, ValueError) as err:
        raise _fail(path, f"{CFG} is not readable JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise _fail(path, f"{CFG} must hold a JSON object")
    cfg = _config(path, raw)
    try:
        weights = load_file(str(path / WEIGHTS), device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise _fail(path, f"{WEIGHTS} is not readable safetensors ({str(err).splitlines()[0]})") from None
    if cfg.activation == "jumprelu" and "threshold" not in weights and "log_threshold" in weights:
        weights["threshold"] = weights.pop("log_threshold").float().exp()
    expected = _expected(cfg)
    sizes = f"d_in {cfg.d_in} and d_sae {cfg.d_sae}" + (f" and d_out {cfg.d_out}" if cfg.transcoder else "")
    for name, shape in expected.items():
        if name not in weights:
            raise _fail(
                path,
                f"{WEIGHTS} has no tensor {name} (a {cfg.architecture} SAE needs "
                f"{', '.join(expected)}; found {', '.join(sorted(weights)) or 'none'})",
            )
        got = tuple(weights[name].shape)
        if got != shape:
            raise _fail(path, f"{name} has shape {list(got)}, expected {list(shape)} from {sizes}")
        if not _finite(weights[name]):
            raise _fail(path, f"{name} holds NaN or infinite values")
    if cfg.architecture == "topk" and raw.get("rescale_acts_by_decoder_norm") is True:
        _fold_decoder_norm(path, weights)
    return Sae(cfg, **{name: weights[name] for name in expected})


def _fold_decoder_norm(path: Path, weights: dict) -> None:
    """A TopK SAE saved with `rescale_acts_by_decoder_norm` (SAELens 6 trains TopK SAEs so): its encode multiplies the
    pre-activations by the decoder rows' norms n and its decode divides the activations by n. The same
    SAE with n folded in (W_enc·n, b_enc·n, W_dec/n, as SAELens folds it) encodes and decodes the same."""
    W_dec = weights["W_dec"].float()
    n = W_dec.norm(dim=-1)
    if not (n > 0).all():
        raise _fail(path, "rescale_acts_by_decoder_norm is set but some rows of W_dec are zero")
    weights["W_enc"] = weights["W_enc"].float() * n
    weights["b_enc"] = weights["b_enc"].float() * n
    weights["W_dec"] = W_dec / n[:, None]


def config_dict(cfg: SaeConfig) -> dict:
    """cfg.json as SAELens 6 writes it."""
    out = {
        "architecture": cfg.architecture,
        "d_in": cfg.d_in,
        "d_sae": cfg.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": cfg.apply_b_dec_to_input,
        "normalize_activations": cfg.normalize_activations,
        "reshape_activations": "hook_z" if cfg.hook_name.endswith("hook_z") else "none",
    }
    if cfg.architecture == "topk":
        out["k"] = cfg.k
    if cfg.transcoder:
        out["d_out"] = cfg.d_out
    site = parse_hook_name(cfg.hook_name)
    meta = {
        "model_name": cfg.model_name,
        "hook_name": cfg.hook_name,
        "hook_layer": site.layer,
        "hook_head_index": None,
        "sae_lens_version": SAE_LENS_FORMAT_VERSION,
        **cfg.metadata,
    }
    meta["hook_name"] = cfg.hook_name
    if cfg.transcoder:
        meta["hook_name_out"] = cfg.hook_name_out
    out["metadata"] = meta
    return out


def write_sae(sae: Sae, path: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write `sae` as an SAELens directory (created if needed); `extra_files`: name -> text written beside."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    if sae.threshold is not None:
        tensors["threshold"] = sae.threshold
    if sae.W_skip is not None:
        tensors["W_skip"] = sae.W_skip
    save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, str(path / WEIGHTS))
    (path / CFG).write_text(json.dumps(config_dict(sae.cfg), indent=2, allow_nan=False) + "\n")
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text)
    return path
