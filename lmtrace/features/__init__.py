"""Sparse autoencoders (SAEs): the SAELens directory format, an SAE's encode/decode, and where its hook
point sits in a model (lmtrace's sites). Knows tensors and files only: no archive, no runner, so the
capture loop below the archive can apply an SAE in its own forward."""

from .format import read_sae, write_sae
from .sae import Sae, SaeConfig
from .sites import Site, parse_hook_name

__all__ = ["Sae", "SaeConfig", "Site", "parse_hook_name", "read_sae", "write_sae"]
