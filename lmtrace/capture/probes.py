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
from .devices import execution_device, stack_on
from .dla import FrozenFinalNorm, FrozenNormDLA
from .lens import LogitLens
from .lens_stats import lens_target_columns, lens_targets
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


def _at_query(
    tensors: list[torch.Tensor], batch: int, prefill: bool, device: torch.device | None = None
) -> torch.Tensor:
    """[n, B, ...] on `device`: the query position of n kept tensors, which at a decode step are the
    modules' outputs ([B, 1, ...], or flattened [B, ...]) and at the prefill already their query
    position [B, ...] (`Probes._keep`). One stack and one slice for all of them (one stack and one
    copy per device when the layers live on several)."""
    if prefill:
        return stack_on(tensors, device)
    if len({t.dim() for t in tensors}) > 1:  # e.g. OPT: attention [B, 1, d] next to a flattened fc2 [B, d]
        tensors = [t.reshape(batch, -1, t.shape[-1]) for t in tensors]
    t = stack_on(tensors, device)
    return t.reshape(len(tensors), batch, -1, t.shape[-1])[:, :, -1]


def _is_plain_eager(fn) -> bool:
    import importlib
    import inspect

    reference = importlib.import_module("transformers.models.llama.modeling_llama").eager_attention_forward
    try:
        return fn is reference or inspect.getsource(fn) == inspect.getsource(reference)
    except (OSError, TypeError):
        return False


class Probes:
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

    # ---- assembly ----------------------------------------------------------------------------
    def _realign_keys(self, rows: torch.Tensor, kv_len: int, out: np.ndarray) -> None:
        """rows [B, ..., kv] over padded keys -> out [B, ..., total_len] over token positions."""
        ctx = self.ctx
        rows_np = rows.to(self.torch_float).cpu().numpy()
        for b, pad in enumerate(ctx.pads):
            first_real = ctx.total_len - kv_len - pad  # token position of key column 0
            j0 = max(0, -first_real)
            out[b, ..., first_real + j0 : first_real + kv_len] = rows_np[b, ..., j0:]
            # a sliding-window cache returned only the last kv_len keys: the earlier tokens are in the
            # context but outside every window this query can see, so the model gave them exactly 0
            out[b, ..., : max(first_real, 0)] = 0.0

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
        resid_in = self._at_query(self.resid_in).float()
        delta = resid_out - resid_in
        norms = torch.stack([resid_out, delta], 0).norm(dim=-1).transpose(1, 2).cpu().numpy()  # [2, B, L]
        scalars["resid_norm"], scalars["delta_norm"] = norms[0], norms[1]
        if self.component_norms:  # attention and MLP outputs of every layer, one stack and one norm
            outputs = _at_query(
                [self.attn_out[layer] for layer in self.layers] + [self.mlp_out[layer] for layer in self.layers],
                B,
                self.ctx.prefill,
                self.device,
            )  # [2L, B, d]
            norms = outputs.float().norm(dim=-1).reshape(2, L, B).transpose(1, 2).cpu().numpy()  # [2, B, L]
            scalars["attn_norm"], scalars["mlp_norm"] = norms[0], norms[1]
        # the final residual, read before the inline lens, whose call of the final norm would pass its tap
        final = (
            _at_query([self.ends["final"]], B, self.ctx.prefill, self.device)[0].float()
            if self.final is not None
            else None
        )  # [B, d]
        if self.dla is not None:
            arrays.update(self._direct_logit_attribution(choice, final))
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

    def _attention_arrays(self) -> dict[str, np.ndarray]:
        """This step's attention rows of every captured layer [B, L, H, ...]: whole rows realigned to
        the context's positions (`attn`), or each head's top-k keys (`attn_topk_idx`, `attn_topk_prob`)."""
        s = self.shape
        B = len(self.ctx.pads)
        L = len(self.layers)
        arrays: dict[str, np.ndarray] = {}
        all_rows = None  # [L, B, H, kv] when every captured layer's row came from the batched product
        if self.batched is not None:
            layers, probs, kv_len = self.batched.rows(self.device)
            if layers == self.layers:
                all_rows = probs
            self.rows.update({layer: (probs[n], kv_len) for n, layer in enumerate(layers)})
        if s.k_attn is None:
            # as wide as this step's context (no key reaches past it): the archive's rows are
            # padded to the run's longest context by the writer, not here
            out = np.full((B, L, s.n_heads, self.ctx.total_len), np.nan, dtype=self.np_float)
            kv_lens = {self.rows[layer][1] for layer in self.layers}
            if len(kv_lens) == 1:  # every layer saw the same keys: realign them all at once
                if all_rows is None:
                    all_rows = stack_on([self.rows[layer][0] for layer in self.layers], self.device)
                self._realign_keys(all_rows.transpose(0, 1), kv_lens.pop(), out)  # [B, L, H, kv]
            else:
                for li, layer in enumerate(self.layers):
                    rows, kv_len = self.rows[layer]
                    self._realign_keys(rows, kv_len, out[:, li])
            arrays["attn"] = out
        else:
            idx_out = np.full((B, L, s.n_heads, s.k_attn), -1, dtype=np.int32)
            prob_out = np.full((B, L, s.n_heads, s.k_attn), np.nan, dtype=self.np_float)
            for li, layer in enumerate(self.layers):
                rows, kv_len = self.rows[layer]
                k = min(s.k_attn, kv_len)
                top = rows.float().topk(k, dim=-1)
                idx = top.indices.cpu().numpy()
                val = top.values.cpu().numpy()
                for b, pad in enumerate(self.ctx.pads):
                    pos = idx[b] + (self.ctx.total_len - kv_len - pad)
                    valid = pos >= 0
                    idx_out[b, li, :, :k] = np.where(valid, pos, -1)
                    prob_out[b, li, :, :k] = np.where(valid, val[b], np.nan)
            arrays["attn_topk_idx"], arrays["attn_topk_prob"] = idx_out, prob_out
        return arrays

    def _activation_arrays(self) -> dict[str, np.ndarray]:
        """This step's q/k/v, top-|a| MLP neurons and MoE routing of every captured layer, as captured."""
        s = self.shape
        B = len(self.ctx.pads)
        L = len(self.layers)
        arrays: dict[str, np.ndarray] = {}
        if s.qkv:
            for name, t in zip(("q", "k", "v"), self._new_qkv()):  # [L, B, heads, D]
                arrays[name] = t.transpose(0, 1).to(self.torch_float).cpu().numpy()
        if s.ffn:  # top-|a| neurons of every layer at once: act [B, L, d_ffn]
            act = self._at_query(self.ffn).transpose(0, 1).float()
            idx = act.abs().topk(min(s.k_ffn, act.shape[-1]), dim=-1).indices
            arrays["ffn_idx"] = idx.cpu().numpy().astype(np.int32)
            arrays["ffn_val"] = act.gather(-1, idx).cpu().numpy()
        if s.k_router:
            idx_out = np.full((B, L, s.k_router), -1, dtype=np.int32)
            w_out = np.full((B, L, s.k_router), np.nan, dtype=np.float32)
            for li, layer in enumerate(self.layers):
                if layer in self.router:
                    idx, w = self.router[layer]
                    idx_out[:, li, : idx.shape[-1]] = idx.cpu().numpy()
                    w_out[:, li, : w.shape[-1]] = w.cpu().numpy()
            arrays["router_topk_idx"], arrays["router_topk_weight"] = idx_out, w_out
        return arrays

    def _lens_columns(self, choice: Choice, resid_out: torch.Tensor, arrays: dict, scalars: dict) -> None:
        """The inline logit lens of every layer's residual resid_out [L, B, d]: its arrays and step columns."""
        B = len(self.ctx.pads)
        L = len(self.layers)
        targets = lens_targets(choice.token.numpy(), choice.alt_ids.numpy())  # [B, 2]: chosen, runner-up
        ids, probs, margin, t_rank, t_prob = self.lens.of_residuals(
            resid_out.transpose(0, 1).reshape(B * L, -1), torch.from_numpy(np.repeat(targets, L, 0))
        )
        arrays["lens_ids"], arrays["lens_probs"] = ids.reshape(B, L, -1), probs.reshape(B, L, -1)
        scalars["lens_top1"] = arrays["lens_ids"][:, :, 0]
        scalars["lens_top1_prob"] = arrays["lens_probs"][:, :, 0]
        scalars["lens_margin"] = margin.reshape(B, L)
        scalars.update(lens_target_columns(t_rank.reshape(B, L, 2), t_prob.reshape(B, L, 2), self.layers))

    def _direct_logit_attribution(self, choice: Choice, final: torch.Tensor) -> dict[str, np.ndarray]:
        """head_dla and its companions (docs/archive.md, "Direct logit attribution"), each [B, ...] float32,
        first for logit(chosen) − logit(runner-up), then (`_logit`) for logit(chosen). final [B, d]: the
        final residual."""
        B, prefill = len(self.ctx.pads), self.ctx.prefill
        targets = torch.from_numpy(lens_targets(choice.token.numpy(), choice.alt_ids.numpy()))  # [B, 2]
        embed = _at_query([self.ends["embed"]], B, prefill, self.device)[0].float()
        u, const = self.dla.directions(final, targets)  # [B, 2, d], [B, 2]
        u = u.to(final.device)
        L = len(self.layers)
        outputs = _at_query(
            [self.attn_out[layer] for layer in self.layers] + [self.mlp_out[layer] for layer in self.layers],
            B,
            prefill,
            self.device,
        ).float()  # [2L, B, d]
        # what each output adds to the residual stream (through the block's frozen post-norm, where it has one)
        outputs, attn_factor = self.dla.residual_parts(self.layers, outputs)
        rest = final - embed - outputs.sum(0)  # the layers not captured (and float rounding)
        blocks = torch.einsum("lbd,btd->lbt", outputs, u)  # [2L, B, 2]: attention outputs, then MLP outputs
        ends = torch.einsum("nbd,btd->nbt", torch.stack([embed, rest], 0), u)  # [2, B, 2]
        heads = self.dla.heads(self.layers, self._at_query(self.o_in), u, attn_factor)  # [L, B, 2, H]
        out = {"dla_runner_up": targets[:, 1].numpy().astype(np.int32)}
        for suffix, t in (("", 0), ("_logit", 1)):
            out["head_dla" + suffix] = heads[:, :, t].transpose(0, 1).cpu().numpy()
            out["attn_dla" + suffix] = blocks[:L, :, t].T.cpu().numpy()
            out["mlp_dla" + suffix] = blocks[L:, :, t].T.cpu().numpy()
            out["embed_dla" + suffix] = ends[0, :, t].cpu().numpy()
            out["rest_dla" + suffix] = ends[1, :, t].cpu().numpy()
            out["bias_dla" + suffix] = const[:, t].cpu().numpy()
        return out

    def _at_query(self, store: dict[int, torch.Tensor], layers: list[int] | None = None) -> torch.Tensor:
        """[L, B, ...]: the query position of a kept per-layer output, for `layers` (default: the captured ones)."""
        return _at_query(
            [store[layer] for layer in (layers or self.layers)], len(self.ctx.pads), self.ctx.prefill, self.device
        )

    def _new_qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value of the query position, every captured layer: [L, B, heads, D] each.

        The new key and value columns are read from the KV cache's stack in one op each when it
        holds every captured layer; otherwise one slice per layer.
        """
        layers = self.layers
        q = stack_on([self.qkv[layer][0] for layer in layers], self.device)[:, :, :, -1]  # one query position kept
        kv = self.ctx.kv
        T = self.qkv[layers[0]][1].shape[2]
        if kv is not None and all(
            kv.holds(layer, self.qkv[layer][1]) and self.qkv[layer][1].shape[2] == T for layer in layers
        ):
            return (q, *kv.column(layers, T - 1, self.device))
        k = stack_on([self.qkv[layer][1][:, :, -1] for layer in layers], self.device)
        v = stack_on([self.qkv[layer][2][:, :, -1] for layer in layers], self.device)
        return q, k, v

    def collect_prefill(self) -> dict[str, np.ndarray]:
        """Prompt-time arrays: prompt K/V and (optionally) full prefill attention, per token position."""
        s = self.shape
        ctx = self.ctx
        B = len(ctx.pads)
        L = len(self.layers)
        out: dict[str, np.ndarray] = {}
        if s.qkv:
            for name, j in (("prompt_k", 0), ("prompt_v", 1)):
                arr = np.full((B, L, s.n_kv_heads, s.max_prompt, s.head_dim), np.nan, dtype=self.np_float)
                for li, layer in enumerate(self.layers):
                    t = self.prompt_kv[layer][j].float().cpu().numpy()  # [B, KVH, kv, D]
                    kv_len = t.shape[2]
                    for b, pad in enumerate(ctx.pads):
                        first_real = ctx.total_len - kv_len - pad
                        j0 = max(0, -first_real)
                        arr[b, li, :, first_real + j0 : first_real + kv_len] = t[b, :, j0:]
                out[name] = arr
        if s.prefill_attention:
            arr = np.full((B, L, s.n_heads, s.max_prompt, s.max_prompt), np.nan, dtype=self.np_float)
            for li, layer in enumerate(self.layers):
                t = self.prefill_rows[layer].float().cpu().numpy()  # [B, H, q, kv]
                q_len, kv_len = t.shape[2], t.shape[3]
                for b, pad in enumerate(ctx.pads):
                    n = ctx.total_len - pad  # prompt length of this row
                    arr[b, li, :, :n, :n] = t[b, :, q_len - n :, kv_len - n :]
            out["prefill_attn"] = arr
        if self.features is not None:
            out.update(self.features.collect_prefill(ctx.pads))
        return out
