"""Where an SAE reads: SAELens / TransformerLens hook names and lmtrace's sites.

An SAE's cfg.json names its hook point the TransformerLens way (`blocks.6.hook_resid_post`). lmtrace
reaches the same tensor through its architecture adapter (lmtrace/capture/arch.py: `layers[i]`,
`attn(i)`, `mlp(i)`, `o_proj(i)`, `mlp_down(i)`), for every supported family:

  site        hook name                          tensor                                         width
  resid_pre   blocks.L.hook_resid_pre            input of block L (block 0: the embeddings,      d_model
                                                 learned positions included)
  resid_post  blocks.L.hook_resid_post           output of block L: the residual stream after    d_model
                                                 layer L (the archive's `resid` at resid_layer L)
  attn_out    blocks.L.hook_attn_out             output of attention L (after its projection)    d_model
  mlp_out     blocks.L.hook_mlp_out              output of MLP L (a transcoder's output site)    d_model
  mlp_in      blocks.L.ln2.hook_normalized       input of MLP L, after the pre-MLP norm (a       d_model
                                                 transcoder's input site); not OPT (no MLP module)
  attn_z      blocks.L.attn.hook_z               input of attention L's output projection:       n_heads*head_dim
                                                 every head's output, concatenated (SAELens
                                                 flattens hook_z the same way)
  mlp_post    blocks.L.mlp.hook_post             input of MLP L's down-projection (the FFN        d_ffn
                                                 activation); not mixture-of-experts models

A transcoder reads one site and writes another; lmtrace serves the pair an MLP transcoder has, one
layer's MLP read at its input and written at its output:

  blocks.L.ln2.hook_normalized -> blocks.L.hook_mlp_out   (mlp_in L -> mlp_out L)

and refuses any other pair in one line (`transcoder_sites`).

Anything else (resid_mid, hook_q/k/v, hook_pattern, one head's hook_z, ...) is refused in one line
that names what is supported. The adapter is taken as it is (duck-typed): this module does not
import the capture package, which sits above it.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..exits.errors import SpecError

# kind -> (hook name with {L}, where lmtrace reads it: adapter module name, input/output)
SITES: dict[str, tuple[str, str, str]] = {
    "resid_pre": ("blocks.{L}.hook_resid_pre", "layer", "input"),
    "resid_post": ("blocks.{L}.hook_resid_post", "layer", "output"),
    "attn_out": ("blocks.{L}.hook_attn_out", "attn", "output"),
    "mlp_out": ("blocks.{L}.hook_mlp_out", "mlp", "output"),
    "mlp_in": ("blocks.{L}.ln2.hook_normalized", "mlp", "input"),
    "attn_z": ("blocks.{L}.attn.hook_z", "o_proj", "input"),
    "mlp_post": ("blocks.{L}.mlp.hook_post", "mlp_down", "input"),
}
_PATTERNS = {
    kind: re.compile("^" + re.escape(hook).replace(re.escape("{L}"), r"(\d+)") + "$")
    for kind, (hook, _, _) in SITES.items()
}


def supported_hooks() -> str:
    return ", ".join(hook.format(L="L") for hook, _, _ in SITES.values())


@dataclass(frozen=True)
class Site:
    layer: int
    kind: str  # a key of SITES

    @property
    def hook_name(self) -> str:
        return SITES[self.kind][0].format(L=self.layer)

    @property
    def archived_resid_layer(self) -> int | None:
        """The `resid_layer` of the archive's `resid` array that holds this site's vectors, or None:
        resid_post L is resid L, resid_pre L (L >= 1) is resid L-1."""
        if self.kind == "resid_post":
            return self.layer
        if self.kind == "resid_pre" and self.layer >= 1:
            return self.layer - 1
        return None

    def locate(self, adapter) -> tuple[torch.nn.Module, str]:
        """(module, "input" | "output"): where the site's tensor is read in `adapter`'s model."""
        self.check_family(adapter)
        _, name, where = SITES[self.kind]
        module = adapter.layers[self.layer] if name == "layer" else getattr(adapter, name)(self.layer)
        return module, where

    def check_family(self, adapter) -> None:
        n = adapter.n_layers
        if not 0 <= self.layer < n:
            raise SpecError(f"{self.hook_name}: layer {self.layer} is out of range: the model has layers 0..{n - 1}")
        family = adapter.family
        if self.kind == "mlp_in" and family.name == "opt":
            raise SpecError(
                f"{self.hook_name}: OPT models have no MLP module whose input is the normalised residual; "
                f"supported there: resid_pre, resid_post, attn_out, mlp_out, attn_z, mlp_post"
            )
        if self.kind == "mlp_post" and family.mlp_down is None:
            raise SpecError(
                f"{self.hook_name}: {family.name} models have no single FFN down-projection "
                f"({family.mlp_kind}); supported there: resid_pre, resid_post, attn_out, mlp_out, "
                f"mlp_in, attn_z"
            )

    def width(self, adapter) -> int:
        """The size of the site's last dimension in `adapter`'s model."""
        if self.kind == "attn_z":
            return adapter.n_heads * adapter.head_dim
        if self.kind == "mlp_post":
            return adapter.d_ffn
        return adapter.d_model

    def check(self, adapter, d_in: int, what: str, dim: str = "d_in") -> None:
        """Refuse (one line, exit 2) a site the model lacks or an SAE whose d_in (a transcoder's output
        site: d_out, `dim`) does not match it."""
        self.check_family(adapter)
        width = self.width(adapter)
        if d_in != width:
            raise SpecError(
                f"{what}: {dim} {d_in} does not match {self.hook_name} of this model, which has width "
                f"{width} ({self.kind}); use an SAE trained on this model"
            )


def parse_hook_name(name: str, what: str = "SAE") -> Site:
    """A SAELens / TransformerLens hook name -> Site; unsupported names are refused in one line."""
    for kind, pattern in _PATTERNS.items():
        m = pattern.match(name or "")
        if m:
            return Site(int(m.group(1)), kind)
    raise SpecError(
        f"{what}: hook point {name!r} is not supported; supported hook points (L a layer): {supported_hooks()}"
    )


TRANSCODER_PAIRS = (("mlp_in", "mlp_out"),)  # (input site, output site), one layer


def transcoder_sites(hook_in: str, hook_out: str, what: str = "SAE") -> tuple[Site, Site]:
    """A transcoder's (input hook, output hook) -> (input Site, output Site); a pair lmtrace cannot
    serve is refused in one line."""
    site_in = parse_hook_name(hook_in, what)
    site_out = parse_hook_name(hook_out, f"{what} (output hook point)")
    if (site_in.kind, site_out.kind) not in TRANSCODER_PAIRS or site_in.layer != site_out.layer:
        pairs = ", ".join(f"{SITES[a][0]} -> {SITES[b][0]}".replace("{L}", "L") for a, b in TRANSCODER_PAIRS)
        raise SpecError(
            f"{what}: a transcoder from {hook_in} to {hook_out} is not supported; supported (L one layer): {pairs}"
        )
    return site_in, site_out


def sae_sites(cfg, what: str = "SAE") -> tuple[Site, Site | None]:
    """An SAE's config -> (where it reads, where a transcoder writes; None for an SAE)."""
    if getattr(cfg, "hook_name_out", None):
        return transcoder_sites(cfg.hook_name, cfg.hook_name_out, what)
    return parse_hook_name(cfg.hook_name, what), None


def check_sae_sites(adapter, cfg, what: str) -> None:
    """Refuse (one line, exit 2) an SAE's or a transcoder's sites the model lacks, or widths (d_in, d_out)
    that do not match them."""
    site_in, site_out = sae_sites(cfg, what)
    site_in.check(adapter, cfg.d_in, what)
    if site_out is not None:
        site_out.check(adapter, cfg.d_out, what, "d_out")


def site_of(layer: int, kind: str) -> Site:
    if kind not in SITES:
        raise SpecError(f"unknown site {kind!r}; expected one of {', '.join(SITES)}")
    return Site(layer, kind)


@contextlib.contextmanager
def at_site(adapter, site: Site, fn: Callable[[torch.Tensor], torch.Tensor | None]):
    """Call fn(tensor) on the site's tensor at every forward of the model while inside; a tensor it
    returns replaces the site's (a reconstruction spliced in), None leaves it. The tensor is what the
    module gives: [batch, pos, width], or [batch*pos, width] where the family flattens tokens (OPT's
    fc2). Hooks are removed on exit, always."""
    module, where = site.locate(adapter)
    if where == "output":

        def hook(mod, args, out):
            tensor = out[0] if isinstance(out, tuple) else out
            new = fn(tensor)
            if new is None:
                return None
            return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new

        handle = module.register_forward_hook(hook)
    else:

        def pre_hook(mod, args, kwargs):
            if args:
                new = fn(args[0])
                return None if new is None else ((new,) + tuple(args[1:]), kwargs)
            new = fn(kwargs["hidden_states"])
            return None if new is None else (args, {**kwargs, "hidden_states": new})

        handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
