"""The edits in the forward pass: `EditSet` installs each entry's hook and knows, at every forward,
which rows and positions an entry applies to. The hooks themselves read and replace components
through `capture/component_hooks.py`, the hooks the sweep's patches use too."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...exits.errors import SpecError
from ...features.edits import apply_feature_edits
from ..component_hooks import edit_component, edit_module, first, replace_first, row_mask
from ..taps import tap
from .entries import (
    CHAT_SPANS,
    AblateAttention,
    AblateHead,
    AblateLayer,
    AblateNeurons,
    Ablation,
    EntryBase,
    FeatureEntry,
    MaskExperts,
    MaskPositions,
    PatchHead,
    PatchResidual,
    Steer,
)


class EditSet:
    """The tracer's `Edits`: installs one hook per entry and knows which rows/positions are active.

    Hooks are registered with `prepend=True`, so they run before the capture hooks of the probes:
    the child's archive records the edited values (an ablated block's norm, the masked router choice).
    """

    def __init__(self, entries: list[EntryBase], adapter, prompt_len: dict[int, int], resources: dict):
        self.entries = entries
        self.adapter = adapter
        self.prompt_len = prompt_len  # sequence -> prompt length
        # entry index -> mean values, patch sources, steer vector, chat spans {seq: (start, end)}, routing rule
        self.resources = resources
        self.step = 0
        self.seq_ids: list[int] = []
        self.positions: torch.Tensor | None = None

    def begin(self, step: int, seq_ids: list[int], positions: torch.Tensor, prefill: bool) -> None:
        self.step, self.seq_ids, self.positions = step, seq_ids, positions

    def _selected(self, entry: EntryBase) -> torch.Tensor | None:
        """[B, q] bool: where this entry applies in the current forward; None when nowhere."""
        if not entry.active_at(self.step):
            return None
        rows = torch.tensor([entry.sequences == "all" or s in entry.sequences for s in self.seq_ids])
        sel = rows[:, None].expand(self.positions.shape).clone()
        if entry.positions != "all":
            sel &= torch.isin(self.positions.cpu(), torch.tensor(entry.positions))
        if not sel.any():
            return None
        return sel.to(self.positions.device)

    def hidden_positions(self, i: int, e: MaskPositions, seq: int, n_ctx: int):
        plen = self.prompt_len[seq]
        if e.span == "prompt":
            return range(plen)
        if e.span == "generated":
            return range(plen, n_ctx)
        if e.span in CHAT_SPANS:
            return range(*self.resources[i][seq])
        return e.mask

    def edit_mask(self, mask: torch.Tensor, pads: list[int], seq_ids: list[int], step: int) -> torch.Tensor:
        edited = None
        for i, e in enumerate(self.entries):
            if not isinstance(e, MaskPositions) or not e.active_at(step):
                continue
            for b, seq in enumerate(seq_ids):
                if e.sequences != "all" and seq not in e.sequences:
                    continue
                n_ctx = mask.shape[1] - pads[b]
                cols = [pads[b] + p for p in self.hidden_positions(i, e, seq, n_ctx) if 0 <= p < n_ctx]
                if cols:
                    edited = mask.clone() if edited is None else edited
                    edited[b, cols] = 0
        return mask if edited is None else edited

    @contextmanager
    def attached(self):
        handles = []
        try:
            for i, e in enumerate(self.entries):
                handles += self._install(i, e)
            by_sae: dict[str, list[int]] = {}  # the feature edits of one SAE share one hook
            for i, e in enumerate(self.entries):
                if isinstance(e, FeatureEntry):
                    by_sae.setdefault(str(self.resources[i].path), []).append(i)
            for indices in by_sae.values():
                handles.append(self._features(indices))
            yield self
        finally:
            for h in handles:
                h.remove()

    def _install(self, i: int, e: EntryBase) -> list:
        """Entry i's hooks; mask_positions has none (it works through `edit_mask`)."""
        if isinstance(e, Ablation):
            return [self._ablation(i, e)]
        if isinstance(e, PatchHead):
            return [self._patch_head(i, e)]
        if isinstance(e, MaskExperts):
            return [self._mask_experts(i, e)]
        if isinstance(e, (PatchResidual, Steer)):
            return [self._residual(i, e)]
        return []

    def _ablation(self, i: int, e: Ablation):
        """A component set to 0 or to its mean (the resource of a `mode: mean` entry) where e applies."""
        a = self.adapter
        mean = self.resources.get(i) if e.mode == "mean" else None
        if e.mode == "mean" and mean is None:
            raise RuntimeError(f"interventions[{i}] ({e.kind}): mean values were not computed")
        if isinstance(e, AblateLayer):
            return self._skip_layer(e, mean)
        if isinstance(e, AblateHead):
            lo, hi = e.head * a.head_dim, (e.head + 1) * a.head_dim

            def ablate_head(x):
                sel = self._selected(e)
                if sel is None:
                    return None
                x = x.clone()
                value = torch.zeros((), dtype=x.dtype, device=x.device) if mean is None else mean.to(x.device, x.dtype)
                x[..., lo:hi] = torch.where(row_mask(sel, x), value, x[..., lo:hi])
                return x

            return edit_component(a, "head", e.layer, ablate_head)
        if isinstance(e, AblateNeurons):
            if a.family.mlp_down is None:
                raise SpecError(
                    f"ablate_neurons: {a.family.name} models have no single MLP "
                    f"down-projection (experts are fused); ablate the MLP block or a layer instead"
                )
            idx = torch.tensor(e.neurons)

            def ablate_neurons(x):
                sel = self._selected(e)
                if sel is None:
                    return None
                x = x.clone()
                cols = idx.to(x.device)
                current = x[..., cols]
                rows = row_mask(sel, x)
                x[..., cols] = (
                    current.masked_fill(rows, 0.0)
                    if mean is None
                    else torch.where(rows, mean[idx].to(x.device, x.dtype), current)
                )
                return x

            return edit_component(a, "ffn", e.layer, ablate_neurons)

        def ablate_block(out):  # ablate_attention, ablate_mlp: the block's output
            sel = self._selected(e)
            if sel is None:
                return None
            rows = row_mask(sel, out)
            return (
                out.masked_fill(rows, 0.0) if mean is None else torch.where(rows, mean.to(out.device, out.dtype), out)
            )

        return edit_component(a, "attn" if isinstance(e, AblateAttention) else "mlp", e.layer, ablate_block)

    def _skip_layer(self, e: AblateLayer, mean):
        """The layer's output replaced by its input (plus its mean residual contribution) where e applies."""

        def skip(module, args, kwargs, output):
            sel = self._selected(e)
            if sel is None:
                return None
            out = first(output)
            x = args[0] if args else kwargs["hidden_states"]  # the block's input
            if mean is not None:
                x = x + mean.to(out.device, out.dtype)
            return replace_first(output, torch.where(sel[..., None], x, out))

        return tap(self.adapter.layers[e.layer], skip, prepend=True)

    def _patch_head(self, i: int, e: PatchHead):
        """The head's slice at the query position replaced by the source's value at the same step."""
        d = self.adapter.head_dim
        lo, hi = e.head * d, (e.head + 1) * d
        source = self.resources[i]

        def patch_head(x):
            sel = self._selected(e)
            if sel is None:
                return None
            x = x.clone()
            for b, seq in enumerate(self.seq_ids):
                if sel[b, -1]:  # the query position; the source holds one value per step
                    v = source(seq, self.step)
                    if v is not None:
                        x[b, -1, lo:hi] = v.to(x.device, x.dtype)
            return x

        return edit_component(self.adapter, "head", e.layer, patch_head)

    def _features(self, indices: list[int]):
        """Entries `indices` (feature edits of one SAE) at its site: at each position the edits active there
        applied together (`features.edits.apply_feature_edits`: the SAE's reconstruction error kept);
        positions no edit selects are left as they are. A transcoder's latents are read at the MLP's input
        and the change is added to the MLP's output (the same module's forward: one tap sees both)."""
        loaded = self.resources[indices[0]]
        module, where = loaded.site.locate(self.adapter)
        entries = [self.entries[i] for i in indices]
        edits = [e.feature_edit() for e in entries]

        def edited(x, out=None):
            active = [(k, sel) for k, sel in enumerate(self._selected(e) for e in entries) if sel is not None]
            if not active:
                return None
            if loaded.sae.W_dec.device != x.device:
                loaded.sae.to(x.device)
            B = len(self.seq_ids)
            rows = x.reshape(B, -1, x.shape[-1])  # [B, q, w]; OPT's fc2 sees [B*q, w]
            target = rows if out is None else out.reshape(B, -1, out.shape[-1])
            code = sum(sel.long() << n for n, (_, sel) in enumerate(active))  # which edits apply, per position
            new = target.clone()
            for c in code.unique().tolist():
                if c:
                    at = code == c
                    chosen = [edits[k] for n, (k, _) in enumerate(active) if c >> n & 1]
                    new[at] = apply_feature_edits(rows[at], loaded.sae, chosen, None if out is None else target[at])
            return new.reshape((x if out is None else out).shape)

        if not loaded.sae.cfg.transcoder:
            return edit_module(module, where, edited)

        def edit_mlp_out(module, args, kwargs, output):
            value = edited(args[0] if args else kwargs["hidden_states"], first(output))
            return None if value is None else replace_first(output, value)

        return tap(module, edit_mlp_out, prepend=True)

    def _mask_experts(self, i: int, e: MaskExperts):
        """The masked experts' router logits set to -inf, then the router's own rule re-applied."""
        rule = self.resources[i]
        experts = torch.tensor(sorted(set(e.experts)))

        def mask_experts(module, args, kwargs, output):
            sel = self._selected(e)
            if sel is None:
                return None
            logits, weights, chosen = output
            rows = sel.reshape(-1, 1)  # the router sees the [B, q] tokens flattened
            cols = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            cols[experts.to(logits.device)] = True
            masked = logits.masked_fill(rows & cols, float("-inf"))
            new_weights, new_chosen = rule(module, masked)
            return (
                masked,
                torch.where(rows, new_weights.to(weights.dtype), weights),
                torch.where(rows, new_chosen, chosen),
            )

        return tap(self.adapter.routers[e.layer], mask_experts, prepend=True)

    def _residual(self, i: int, e: PatchResidual | Steer):
        """The residual after the layer steered (+ alpha * v) or, at the query position, patched."""
        resource = self.resources[i]

        def edit_residual(out):
            sel = self._selected(e)
            if sel is None:
                return None
            out = out.clone()
            if isinstance(e, Steer):
                v = resource.to(out.dtype).to(out.device)
                return torch.where(sel[..., None], out + e.alpha * v, out)
            for b, seq in enumerate(
                self.seq_ids
            ):  # only the query position's residual is archived, so only it is patched
                if sel[b, -1]:
                    src = resource(seq, self.step)
                    if src is not None:
                        out[b, -1] = torch.as_tensor(src, dtype=out.dtype, device=out.device)
            return out

        return edit_component(self.adapter, "resid", e.layer, edit_residual)
