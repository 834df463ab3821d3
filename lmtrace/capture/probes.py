"""Capture hooks: what is recorded at the query position of every forward call.

Hooks are registered only for what the spec asks for (an unasked probe costs nothing) and are
always removed in a `finally`. Each forward call fills per-layer buffers; `collect` turns them into
numpy arrays with a leading batch-row dim, keys re-aligned from the padded batch to token positions
(key index k = token position k of that sequence, NaN beyond the context).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..archive.layout import RunShape
from . import attention
from .arch import Adapter
from .attention_rows import BatchedRows, plain_attention_probs
from .devices import execution_device
from .dla import FrozenFinalNorm, FrozenNormDLA
from .lens import LogitLens
from .probe_arrays import ProbeArrays, at_query
from .sampling import Choice
from .taps import tap


@dataclass
class ForwardContext:
    """What the probes need to know about the batch being run."""

    pads: list[int]  # left padding of each row
    total_len: int  # padded context length after this call
    prefill: bool
    kv: object = None  # the KV cache's KVStacks (lmtrace/capture/kv_cache.py), if the cache has them


def _last(t, batch: int) -> torch.Tensor:
    """The query position of a [B, pos, ...] output; blocks that flatten tokens (OPT's fc1/fc2 see
    [B*pos, ...]) are unflattened first."""
    if isinstance(t, tuple):
        t = t[0]
    if t.dim() == 2:
        t = t.reshape(batch, -1, t.shape[-1])
    return t[:, -1]


def _is_plain_eager(fn) -> bool:
    import importlib
    import inspect

    reference = importlib.import_module("transformers.models.llama.modeling_llama").eager_attention_forward
    try:
        return fn is reference or inspect.getsource(fn) == inspect.getsource(reference)
    except (OSError, TypeError):
        return False


class Probes(ProbeArrays):
    def __init__(
        self,
        adapter: Adapter,
        shape: RunShape,
        *,
        component_norms: bool,
        margin_contributions: bool,
        lens_dtype: str = "float32",
        inner_attention=None,
        features=None,
    ):
        self.adapter = adapter
        self.features = features  # capture.features: a FeatureProbe (lmtrace/capture/feature_probe.py), or None
        self.shape = shape
        self.layers = list(shape.layers)
        self.pos = {layer: i for i, layer in enumerate(self.layers)}
        self.component_norms = component_norms
        self.margin_contributions = margin_contributions
        self.want_attention = shape.attention or shape.qkv or shape.prefill_attention
        self.want_residual = True  # residual norms are always captured when any probe is on
        self.inner = inner_attention
        if inner_attention is not None:  # so that a forward outside `attached` still runs the right kernel
            for i in range(adapter.n_layers):
                adapter.attn(i)._lmtrace_inner = inner_attention
        self.eager = adapter.eager_attention() if self.want_attention else None
        # When the model's eager kernel is the plain one (scaled q·k + additive mask + float32
        # softmax, as Llama's), the rows are computed here with grouped matmuls instead: same
        # formula, without copying every key per query head (repeat_kv) or computing the output.
        self.plain_eager = self.eager is not None and _is_plain_eager(self.eager)
        # ... and, for the rows of the query position, all layers at once (lmtrace/capture/attention_rows.py)
        self.batched = BatchedRows() if self.plain_eager and shape.attention else None
        self.row_method = (
            None
            if self.eager is None
            else "softmax(q·kᵀ·scaling + mask) in float32 (the model's eager formula), all captured "
            "layers in one grouped product over the stacked KV cache; per layer where a layer's "
            "keys are not in the stack (e.g. a sliding window)"
            if self.batched is not None
            else "the model's eager attention function, per layer"
        )
        self.np_float = np.dtype(shape.float_dtype)
        # archived floats are converted by torch (vectorised) before numpy sees them: numpy's
        # float32 -> float16 cast is several times slower, ~1 ms a step for the attention rows
        self.torch_float = {"float16": torch.float16, "float32": torch.float32}[shape.float_dtype]
        # ... and so are the residual vectors (`resid`, float16 in the default capture): 32 rows of a
        # batch are ~0.5 M values a step, ~1.3 ms a step cast by numpy into the block's buffer
        self.torch_resid = {"float16": torch.float16, "float32": torch.float32}[shape.resid_dtype]
        self.lens = LogitLens(adapter, shape.k_lens, lens_dtype) if shape.lens else None
        # where a step's per-layer tensors are assembled: next to the final norm and unembedding,
        # which the lens and the margin contributions need (the model's one device, unless spread)
        self.device = execution_device(adapter.unembed)
        # per-head direct logit attribution (lmtrace/capture/dla.py): refused here, before any run
        # directory exists, for a model where it cannot be exact
        self.dla = FrozenNormDLA(adapter) if shape.head_dla and self.layers else None
        # the final norm frozen at the final residual's scale, for the margin contributions (and the DLA)
        self.final = (
            self.dla.final
            if self.dla is not None
            else FrozenFinalNorm(adapter, "capture.margin_contributions")
            if margin_contributions
            else None
        )
        self.ctx: ForwardContext | None = None
        self.kernel_args: dict[int, dict] = {}  # layer -> what the attention kernel was called with (manifest)
        self._reset()

    # ---- lifecycle --------------------------------------------------------------------------
    def _reset(self) -> None:
        self.resid_in: dict[int, torch.Tensor] = {}
        self.resid_out: dict[int, torch.Tensor] = {}
        # the taps and the observer keep the tensors the forward produced (references: no op per
        # layer); `collect` takes the query position of all layers at once
        self.attn_out: dict[int, torch.Tensor] = {}  # layer -> attention-block output [B, pos, d]
        self.mlp_out: dict[int, torch.Tensor] = {}  # layer -> MLP-block output [B, pos, d]
        self.ffn: dict[int, torch.Tensor] = {}  # layer -> MLP intermediate activation [B, pos, d_ffn]
        self.rows: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> ([B, H, kv], kv_len)
        self.qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # q [B,H,pos,D], k/v [B,KVH,kv,D]
        self.prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prefill_rows: dict[int, torch.Tensor] = {}
        self.router: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (expert ids, weights) [B, k]
        self.o_in: dict[int, torch.Tensor] = {}  # layer -> output projection input (heads concatenated) [B, pos, H*D]
        self.ends: dict[str, torch.Tensor] = {}  # "embed" (block 0's input), "final" (the final norm's input)

    def begin(self, ctx: ForwardContext) -> None:
        self.ctx = ctx
        self._reset()
        if self.features is not None:
            self.features.begin()
        if ctx.prefill and self.batched is not None:
            self.batched.new_batch(ctx.kv)

    @contextmanager
    def attached(self):
        handles = []
        a = self.adapter
        try:
            for layer in self.layers:
                handles.append(tap(a.layers[layer], self._block_tap(layer)))
                if self.component_norms or self.dla is not None:
                    handles.append(tap(a.attn(layer), self._output_tap("attn_out", layer)))
                    handles.append(tap(a.mlp(layer), self._output_tap("mlp_out", layer)))
                if self.dla is not None:
                    handles.append(tap(a.o_proj(layer), self._input_tap("o_in", layer)))
                if self.shape.ffn:
                    handles.append(tap(a.mlp_down(layer), self._ffn_tap(layer)))
                if self.shape.k_router and a.routers[layer] is not None:
                    handles.append(tap(a.routers[layer], self._router_tap(layer)))
            for layer in sorted(set(self.shape.resid_layers) - set(self.layers)):  # `residual.vectors_at` only
                handles.append(tap(a.layers[layer], self._block_tap(layer, keep_input=False)))
            if self.dla is not None:  # the residual stream's start: the embedding
                handles.append(tap(a.layers[0], self._input_tap("ends", "embed")))
            if self.final is not None:  # ... and its end: the final norm's input
                handles.append(tap(self.final.entry, self._input_tap("ends", "final")))
            if self.features is not None:
                handles.extend(self.features.attach(lambda: self.ctx))
            with attention.observing(self if self.want_attention else None):
                yield self
        finally:
            for h in handles:
                h.remove()

    # ---- taps (lmtrace/capture/taps.py: forward hooks without torch's slow hook path) -----------------
    # At a decode step they only keep references to what the module got and returned: every torch
    # op here would run once per layer (~120 taps a step), while `collect` stacks all layers and
    # does the arithmetic once per step (one slice, one norm, one top-k). At the prefill they keep
    # a copy of the query position: a reference would hold every prompt position of every layer.
    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        return _last(t, len(self.ctx.pads)).clone() if self.ctx.prefill else t

    def _block_tap(self, layer, keep_input: bool = True):
        def block(module, args, kwargs, output):
            if keep_input:
                self.resid_in[layer] = self._keep(args[0] if args else kwargs["hidden_states"])
            self.resid_out[layer] = self._keep(output[0] if type(output) is tuple else output)

        return block

    def _output_tap(self, store: str, layer):
        def output(module, args, kwargs, out):
            getattr(self, store)[layer] = self._keep(out[0] if type(out) is tuple else out)

        return output

    def _input_tap(self, store: str, key):
        def first_input(module, args, kwargs, output):
            getattr(self, store)[key] = self._keep(args[0] if args else next(iter(kwargs.values())))

        return first_input

    def _ffn_tap(self, layer):
        def ffn(module, args, kwargs, output):  # the down-projection's input: the MLP activation
            self.ffn[layer] = self._keep(args[0] if args else next(iter(kwargs.values())))

        return ffn

    def _router_tap(self, layer):
        def router(module, args, kwargs, output):
            # every supported router returns (logits, weights, expert ids) over flattened tokens [B*pos, k]
            _, weights, idx = output
            B = len(self.ctx.pads)
            self.router[layer] = (_last(idx, B).detach(), _last(weights, B).detach().float())

        return router

    def observe(self, module, query, key, value, attention_mask, weights, kwargs) -> None:
        """Called by the lmtrace attention function with post-rotary q [B,H,q,D], k/v [B,KVH,kv,D]."""
        layer = self.adapter.layer_of_attention(module)
        if layer not in self.pos:
            return
        if layer not in self.kernel_args:
            scaling = kwargs.get("scaling")
            self.kernel_args[layer] = {
                "scaling": float(scaling if scaling is not None else query.shape[-1] ** -0.5),
                "softcap": kwargs.get("softcap"),
                "sliding_window": kwargs.get("sliding_window"),
                "sinks": getattr(module, "sinks", None) is not None or kwargs.get("s_aux") is not None,
            }
        prefill = self.ctx.prefill
        full_prefill = prefill and self.shape.prefill_attention
        # the query position [B, H, 1, D]: a decode step has only it; of a prefill's, a copy (a view
        # would keep every prompt position of the layer alive until `collect`)
        q_last = query[:, :, -1:].clone() if prefill else query
        if (
            weights is None
            and self.batched is not None
            and not full_prefill
            and self.batched.offer(layer, q_last, key, attention_mask, self.kernel_args[layer]["scaling"])
        ):
            pass  # the row comes from the batched product in `collect`
        elif self.shape.attention or full_prefill:
            if weights is not None:  # the eager kernel already returned them
                probs = weights
            else:
                q_rows = query if (prefill and self.shape.prefill_attention) else query[:, :, -1:]
                mask = attention_mask
                if mask is not None and q_rows.shape[2] != mask.shape[2]:
                    mask = mask[:, :, -q_rows.shape[2] :]
                if self.plain_eager:
                    probs = plain_attention_probs(q_rows, key, mask, self.kernel_args[layer]["scaling"])
                else:
                    extra = {k: v for k, v in kwargs.items() if k not in ("dropout", "scaling")}
                    _, probs = self.eager(
                        module, q_rows, key, value, mask, dropout=0.0, scaling=kwargs.get("scaling"), **extra
                    )
            self.rows[layer] = (probs[:, :, -1].detach(), key.shape[2])
            if full_prefill:
                self.prefill_rows[layer] = probs.detach()
        if self.shape.qkv:
            self.qkv[layer] = (q_last, key, value)
            if prefill:
                self.prompt_kv[layer] = (key, value)

    # ---- assembly (the per-kind arrays and collect_prefill: probe_arrays.ProbeArrays) ----------------
    def _with_deltas(self, resid_out: torch.Tensor) -> torch.Tensor:
        """resid_out [L, B, d] float -> [2, L, B, d]: resid_out, then each captured layer's output
        minus its input. At a decode step a layer's input is the tensor the layer before returned
        (the taps keep references), so for consecutive layers the inputs are resid_out shifted by
        one: only the first layer's is stacked, and the differences are written in place."""
        layers, kept_in = self.layers, self.resid_in
        shared = (
            bool(layers)
            and not self.ctx.prefill
            and all(
                layer == prev + 1 and kept_in[layer] is self.resid_out[prev] for prev, layer in zip(layers, layers[1:])
            )
        )
        if not shared:
            return torch.stack([resid_out, resid_out - self._at_query(kept_in).float()], 0)
        both = torch.empty((2, *resid_out.shape), dtype=resid_out.dtype, device=resid_out.device)
        both[0].copy_(resid_out)
        torch.sub(resid_out[1:], resid_out[:-1], out=both[1, 1:])
        torch.sub(resid_out[0], self._at_query(kept_in, layers[:1])[0], out=both[1, 0])
        return both

    def collect(self, logits: torch.Tensor, choice: Choice) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Return (zarr arrays per step [B, ...], per-layer scalars [B, layer]) for this forward call."""
        s = self.shape
        B = len(self.ctx.pads)
        L = len(self.layers)
        arrays: dict[str, np.ndarray] = self._attention_arrays() if s.attention else {}
        arrays.update(self._activation_arrays())
        scalars: dict[str, np.ndarray] = {}
        resid_out = self._at_query(self.resid_out).float()  # [L, B, d]
        if s.resid_layers:
            resid = (
                resid_out
                if list(s.resid_layers) == self.layers
                else self._at_query(self.resid_out, s.resid_layers).float()
            )
            arrays["resid"] = resid.transpose(0, 1).to(self.torch_resid).cpu().numpy()
        both = self._with_deltas(resid_out)  # [2, L, B, d]: resid_out, what each layer added
        delta = both[1]
        norms = both.norm(dim=-1).transpose(1, 2).cpu().numpy()  # [2, B, L]
        scalars["resid_norm"], scalars["delta_norm"] = norms[0], norms[1]
        outputs = None  # attention and MLP outputs of every layer [2L, B, d]: one stack for the norms and the DLA
        if self.component_norms or self.dla is not None:
            outputs = at_query(
                [self.attn_out[layer] for layer in self.layers] + [self.mlp_out[layer] for layer in self.layers],
                B,
                self.ctx.prefill,
                self.device,
            ).float()
        if self.component_norms:  # one norm for all of them
            norms = outputs.norm(dim=-1).reshape(2, L, B).transpose(1, 2).cpu().numpy()  # [2, B, L]
            scalars["attn_norm"], scalars["mlp_norm"] = norms[0], norms[1]
        # the final residual, read before the inline lens, whose call of the final norm would pass its tap
        final = (
            at_query([self.ends["final"]], B, self.ctx.prefill, self.device)[0].float()
            if self.final is not None
            else None
        )  # [B, d]
        if self.dla is not None:
            arrays.update(self._direct_logit_attribution(choice, final, outputs))
        if self.margin_contributions:
            # logit(top-1) − logit(top-2) through the final norm frozen at the final residual's scale,
            # so each layer's share is in logits and, with the embedding's and the biases', sums to `margin`
            u, _ = self.final.directions(final, choice.alt_ids[:, :2])  # [B, 2, d]
            direction = (u[:, 0] - u[:, 1]).to(self.device)
            scalars["margin_contrib"] = torch.einsum("lbd,bd->bl", delta, direction).cpu().numpy()
        if s.lens:  # final norm + unembedding of every layer's residual, all layers in one product
            self._lens_columns(choice, resid_out, arrays, scalars)
        if self.features is not None:
            arrays.update(self.features.collect())
        return arrays, scalars
