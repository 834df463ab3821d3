"""A registered attention function that lets the forward run with sdpa and still sees Q, K, V.

transformers dispatches every attention call through `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`.
We register `lmtrace` there: it runs the real kernel (sdpa, or the model's own eager function for
models sdpa cannot run, e.g. with attention soft-capping) and, when a recorder is active, hands the
post-rotary query, the cache-updated key/value and the mask to it. Probabilities are then obtained
by calling the model's *own* eager attention function on just the rows we want, so soft-capping,
sliding windows, sinks and padding are exactly the model's (tests check equality with eager
`output_attentions`; tests/test_architectures.py does it for every supported family).

The real kernel is the model's eager function, not sdpa, when sdpa cannot reproduce the model
(`Adapter.eager_kernel_reason`: the class sets `_supports_sdpa = False` because of soft-capping or
sinks, or the config has attention soft-capping); the weights it returns are then archived as they
are, and the manifest records `attention.kernel: eager` with the reason. Sliding-window layers get
only the cached window of keys (`key` may be shorter than the context): the probes map key column j
to position total_len - kv_len + j and archive the evicted, in-context keys as probability 0.

A custom attention name must also be registered in `ALL_MASK_ATTENTION_FUNCTIONS`, or transformers
silently builds no mask at all. We register the eager (additive float) mask, which sdpa accepts
too and which the probes add to their scores, except at a one-query step that sdpa would run
without a mask: no padding and no window exceeded, so the query sees every key. There the mask is
None, as sdpa's own mask function gives it. Every eager kernel of the supported families skips a
None mask, and the probes then add none. Building the float mask cost ~0.25 ms a decode step, and
sdpa given one ran ~8 µs slower per layer (docs/archive.md, "Cost").
"""

from __future__ import annotations

from typing import Protocol

import torch

ATTN_NAME = "lmtrace"

_active: "AttentionObserver | None" = None


class AttentionObserver(Protocol):
    inner: object

    def observe(self, module, query, key, value, attention_mask, weights, kwargs) -> None: ...


def _lmtrace_attention(module, query, key, value, attention_mask, **kwargs):
    observer = _active
    if observer is None:  # a forward outside the probes: the kernel chosen for this module, else sdpa
        inner = getattr(module, "_lmtrace_inner", None)
        if inner is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as inner
        return inner(module, query, key, value, attention_mask, **kwargs)
    out, weights = observer.inner(module, query, key, value, attention_mask, **kwargs)
    observer.observe(module, query, key, value, attention_mask, weights, kwargs)
    return out, weights


def _lmtrace_mask(
    *, q_length: int, allow_is_causal_skip: bool = True, dtype: torch.dtype = torch.float32, **kwargs
) -> torch.Tensor | None:
    """transformers' eager mask, or None where sdpa's mask function skips the mask of a one-query step."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    if q_length != 1 or not allow_is_causal_skip:
        return eager_mask(q_length=q_length, dtype=dtype, **kwargs)
    mask = sdpa_mask(q_length=q_length, allow_is_causal_skip=True, **kwargs)
    if mask is None:
        return None
    # what eager_mask makes of the same boolean mask, without building it a second time
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, _lmtrace_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, _lmtrace_mask)


class observing:
    """Context manager: route attention calls to `observer` while active."""

    def __init__(self, observer: AttentionObserver | None):
        self.observer = observer
        self.previous = None

    def __enter__(self):
        global _active
        self.previous, _active = _active, self.observer
        return self.observer

    def __exit__(self, *exc):
        global _active
        _active = self.previous
        return False


def install(model: torch.nn.Module) -> str:
    """Switch a loaded model to the lmtrace attention function; returns the previous implementation."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    return previous
