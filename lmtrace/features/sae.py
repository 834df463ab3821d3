"""An SAE as SAELens applies it at inference: `encode` (input normalisation, `b_dec` subtracted when
`apply_b_dec_to_input`, `W_enc`, `b_enc`, the architecture's activation) and `decode` (`W_dec`, `b_dec`,
the normalisation undone).

Shapes: x [..., d_in] -> acts [..., d_sae] -> reconstruction [..., d_in]; weights W_enc [d_in, d_sae],
b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in], threshold [d_sae] (JumpReLU only). Computed in
float32 whatever the input dtype; the result has the input's dtype.

Architectures (cfg.json `architecture`):
  standard  ReLU(pre)
  jumprelu  ReLU(pre) where pre > threshold, else 0 (also a BatchTopK SAE as SAELens saves it for
            inference: its batch threshold becomes a JumpReLU threshold)
  topk      the k largest entries of pre, each ReLU'd; the others 0
with pre = (norm_in(x) - b_dec·apply_b_dec_to_input) @ W_enc + b_enc.

Transcoders (SAELens's Transcoder classes): encode the input site, decode to another (d_out wide), so
W_dec [d_sae, d_out], b_dec [d_out], and b_dec is never subtracted from the input (apply_b_dec_to_input
is false, as SAELens requires):
  transcoder                ReLU, output acts @ W_dec + b_dec
  jumprelu_transcoder       JumpReLU (threshold [d_sae]), output as transcoder
  skip_transcoder           ReLU, output acts @ W_dec + b_dec + x @ W_skip.T  (W_skip [d_out, d_in])
  jumprelu_skip_transcoder  JumpReLU, output as skip_transcoder
`forward(x)` is that output; `decode(acts)` is acts @ W_dec + b_dec, without the skip term (as SAELens's
decode), so a difference of two decodes, a feature edit's, is the same with or without it.

Input normalisation (`normalize_activations`), as SAELens's SAE applies it:
  none                      identity
  expected_average_only_in  identity at inference: SAELens folds the training-time scale into the
                            weights when it saves (a cfg that still names it is applied as SAELens does)
  constant_norm_rescale     x · sqrt(d_in) / ||x|| in, divided by that factor out
  layer_norm                (x - mean) / (std + 1e-5) in (unbiased std), · std + mean out
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ARCHITECTURES = ("standard", "jumprelu", "topk")
TRANSCODERS = ("transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder")
_ACTIVATION = {
    "transcoder": "standard",
    "skip_transcoder": "standard",
    "jumprelu_transcoder": "jumprelu",
    "jumprelu_skip_transcoder": "jumprelu",
}
NORMALISATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")


@dataclass
class SaeConfig:
    architecture: str  # one of ARCHITECTURES or TRANSCODERS
    d_in: int
    d_sae: int
    hook_name: str  # SAELens / TransformerLens hook point, e.g. blocks.6.hook_resid_post
    k: int | None = None  # topk only
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    dtype: str = "float32"
    model_name: str | None = None
    metadata: dict = field(default_factory=dict)  # cfg.json's other metadata, written back unchanged
    d_out: int | None = None  # transcoders: the width of the output site
    hook_name_out: str | None = None  # transcoders: the output hook point, e.g. blocks.6.hook_mlp_out

    @property
    def transcoder(self) -> bool:
        return self.architecture in TRANSCODERS

    @property
    def skip(self) -> bool:
        """A skip transcoder: its output adds x @ W_skip.T."""
        return self.architecture in ("skip_transcoder", "jumprelu_skip_transcoder")

    @property
    def activation(self) -> str:
        """standard | jumprelu | topk: the activation the architecture applies."""
        return _ACTIVATION.get(self.architecture, self.architecture)

    @property
    def width_out(self) -> int:
        """The width decode writes: d_out for a transcoder, d_in for an SAE."""
        return self.d_out if self.transcoder and self.d_out is not None else self.d_in


@dataclass
class InputNorm:
    """What `decode` needs to undo the input normalisation of the x it reconstructs: scale [..., 1]
    (constant_norm_rescale, layer_norm) and shift [..., 1] (layer_norm); None when there is none."""

    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None


class Sae(torch.nn.Module):
    def __init__(
        self,
        cfg: SaeConfig,
        W_enc: torch.Tensor,
        b_enc: torch.Tensor,
        W_dec: torch.Tensor,
        b_dec: torch.Tensor,
        threshold: torch.Tensor | None = None,
        W_skip: torch.Tensor | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.W_enc = torch.nn.Parameter(W_enc.detach().float(), requires_grad=False)
        self.b_enc = torch.nn.Parameter(b_enc.detach().float(), requires_grad=False)
        self.W_dec = torch.nn.Parameter(W_dec.detach().float(), requires_grad=False)
        self.b_dec = torch.nn.Parameter(b_dec.detach().float(), requires_grad=False)
        self.threshold = (
            torch.nn.Parameter(threshold.detach().float(), requires_grad=False) if threshold is not None else None
        )
        self.W_skip = torch.nn.Parameter(W_skip.detach().float(), requires_grad=False) if W_skip is not None else None

    # --- input normalisation -------------------------------------------------------------------
    def normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, InputNorm]:
        """x [..., d_in] float32 -> (normalised x, what undoes it)."""
        how = self.cfg.normalize_activations
        if how == "constant_norm_rescale":
            scale = (self.cfg.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * scale, InputNorm(scale=scale)
        if how == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centred = x - mu
            std = centred.std(dim=-1, keepdim=True)
            return centred / (std + 1e-5), InputNorm(scale=std, shift=mu)
        return x, InputNorm()

    def rescale_out(self, y: torch.Tensor, norm: InputNorm | None) -> torch.Tensor:
        """The input normalisation's scale undone on y [..., d_in] (not its shift): a difference of two
        decodes of one input, such as a feature edit's, needs only this."""
        how = self.cfg.normalize_activations
        if how in ("constant_norm_rescale", "layer_norm"):
            if norm is None or norm.scale is None:
                raise ValueError(
                    f"decode of an SAE with normalize_activations={how} needs the InputNorm of its input "
                    f"(use encode_with_norm or reconstruct)"
                )
            return y / norm.scale if how == "constant_norm_rescale" else y * norm.scale
        return y

    def _denormalise(self, y: torch.Tensor, norm: InputNorm | None) -> torch.Tensor:
        y = self.rescale_out(y, norm)
        return y + norm.shift if self.cfg.normalize_activations == "layer_norm" else y

    # --- encode / decode -----------------------------------------------------------------------
    def pre_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, InputNorm]:
        """x [..., d_in] -> (pre [..., d_sae] float32, InputNorm)."""
        x, norm = self.normalise(x.float())
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc, norm

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """pre [..., d_sae] -> acts [..., d_sae]: the architecture's activation."""
        arch = self.cfg.activation
        if arch == "standard":
            return torch.relu(pre)
        if arch == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold)
        if arch == "topk":
            top = pre.topk(self.cfg.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
        raise ValueError(f"unknown SAE architecture {arch!r}")

    def encode_with_norm(self, x: torch.Tensor) -> tuple[torch.Tensor, InputNorm]:
        pre, norm = self.pre_activations(x)
        return self.activate(pre), norm

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_in] -> feature activations [..., d_sae] (float32)."""
        return self.encode_with_norm(x)[0]

    def decode(self, acts: torch.Tensor, norm: InputNorm | None = None) -> torch.Tensor:
        """acts [..., d_sae] -> reconstruction [..., d_in] (float32); `norm`: from encode_with_norm, needed
        only when the SAE normalises its input per token."""
        return self._denormalise(acts.float() @ self.W_dec + self.b_dec, norm)

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_in] -> its reconstruction, in x's dtype (a transcoder: its output, `forward`)."""
        if self.cfg.transcoder:
            return self.forward(x).to(x.dtype)
        acts, norm = self.encode_with_norm(x)
        return self.decode(acts, norm).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_in] -> an SAE's reconstruction [..., d_in], a transcoder's output [..., d_out] (float32):
        decode(encode(x)), plus x @ W_skip.T for a skip transcoder."""
        acts, norm = self.encode_with_norm(x)
        out = self.decode(acts, norm)
        if self.W_skip is not None:
            out = out + x.float() @ self.W_skip.T
        return out

    def top_active(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., d_in] -> (ids [..., k] int64, values [..., k] float32): the k largest activations of each
        token, largest first; entries past a token's active count have value 0."""
        acts = self.encode(x)
        top = acts.topk(min(k, self.cfg.d_sae), dim=-1)
        return top.indices, top.values
