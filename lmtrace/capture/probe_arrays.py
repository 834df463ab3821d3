"""Assembly of a step's arrays from what the probes' taps kept (capture/probes.py): the attention
rows realigned to token positions, q/k/v, MLP neurons, MoE routing, the inline logit lens, the direct
logit attribution and the prompt-time arrays. `Probes` has these as methods (ProbeArrays is its base)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .devices import stack_on
from .lens_stats import lens_target_columns, lens_targets
from .topk import topk_last

if TYPE_CHECKING:
    from .sampling import Choice


def at_query(
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


class ProbeArrays:
    """The per-step and prompt-time arrays of `Probes` (capture/probes.py), read from the tensors its
    taps and attention observer kept for the forward call in `self.ctx`."""

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
        if s.ffn:  # top-|a| neurons of every layer at once: act [L, B, d_ffn], each row on its own
            act = self._at_query(self.ffn).float()
            _, idx = topk_last(act.abs(), min(s.k_ffn, act.shape[-1]))
            arrays["ffn_idx"] = idx.transpose(0, 1).to(torch.int32).cpu().numpy()
            arrays["ffn_val"] = act.gather(-1, idx).transpose(0, 1).cpu().numpy()
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

    def _direct_logit_attribution(
        self, choice: Choice, final: torch.Tensor, outputs: torch.Tensor
    ) -> dict[str, np.ndarray]:
        """head_dla and its companions (docs/archive.md, "Direct logit attribution"), each [B, ...] float32,
        first for logit(chosen) − logit(runner-up), then (`_logit`) for logit(chosen). final [B, d]: the
        final residual; outputs [2L, B, d] float: the attention outputs of every captured layer, then
        the MLP outputs."""
        B, prefill = len(self.ctx.pads), self.ctx.prefill
        targets = torch.from_numpy(lens_targets(choice.token.numpy(), choice.alt_ids.numpy()))  # [B, 2]
        embed = at_query([self.ends["embed"]], B, prefill, self.device)[0].float()
        u, const = self.dla.directions(final, targets)  # [B, 2, d], [B, 2]
        u = u.to(final.device)
        L = len(self.layers)
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
        return at_query(
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
