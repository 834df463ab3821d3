"""Interventions as data: typed entries (where + when), validated against a model, installed as hooks.

Edits of a module's input are torch forward pre-hooks; edits of its output are taps
(`lmtrace/taps.py`) added first, so the probes' taps on the same module record the edited output.

Every kind edits the real forward pass; nothing perturbs logits after the fact. An edit active at
step s applies to the positions the forward computes at that step (all prompt positions at the
prefill, the query position afterwards); K/V cached at earlier steps keep the values they had.

Kinds (registry `KINDS`, each writable in YAML and stored in the child's manifest):
  ablate_head       the head's slice of the output projection's input set to 0 or to its mean
  ablate_attention  the attention block's output set to 0 or to its mean
  ablate_mlp        the MLP block's output set to 0 or to its mean
  ablate_neurons    chosen neurons of the MLP intermediate activation set to 0 or to their mean
  ablate_layer      skip the layer (its output is its input), or add its mean residual contribution
  mask_positions    hide token positions (or a prompt / generated / chat system / chat user span) from
                    every query through the attention mask
  patch_residual    replace the residual after a layer at the query position with another run's archived vector
  patch_head        replace one head's slice of the output projection's input at the query position with
                    that head's value in another run at the same step (teacher-forced replay of that run)
  steer             add alpha * v to the residual after a layer
  mask_experts      remove experts from a MoE router's choice (their router logits -inf before the
                    family's own top-k and normalisation)

Mean values (`mode: mean`) are the component's mean over every token position of every final
sequence (prompt + generated tokens) of the parent, each run alone in one teacher-forced forward of
the unedited model (`component_means`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from ..exits.errors import SpecError, UnsupportedArchitectureError
from ..spec.steps import parse_range_list  # noqa: F401  (also imported from here by sweeps)
from .taps import tap


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sequences: Literal["all"] | list[int] = "all"
    steps: Literal["all"] | list[int] | dict[Literal["from"], int] = "all"
    positions: Literal["all"] | list[int] = "all"

    def active_at(self, step: int) -> bool:
        if self.steps == "all":
            return True
        if isinstance(self.steps, dict):
            return step >= self.steps["from"]
        return step in self.steps

    def first_step(self) -> int:
        if self.steps == "all":
            return 0
        if isinstance(self.steps, dict):
            return self.steps["from"]
        return min(self.steps) if self.steps else 10**9


class _Ablation(_Entry):
    mode: Literal["zero", "mean"] = "zero"


class AblateHead(_Ablation):
    kind: Literal["ablate_head"]
    layer: int
    head: int


class AblateAttention(_Ablation):
    kind: Literal["ablate_attention"]
    layer: int


class AblateMlp(_Ablation):
    kind: Literal["ablate_mlp"]
    layer: int


class AblateNeurons(_Ablation):
    kind: Literal["ablate_neurons"]
    layer: int
    neurons: list[int] = Field(min_length=1)


class AblateLayer(_Ablation):
    kind: Literal["ablate_layer"]
    layer: int


SPANS = ("prompt", "generated", "system", "user")
CHAT_SPANS = ("system", "user")


class MaskPositions(_Entry):
    kind: Literal["mask_positions"]
    mask: list[int] | None = None  # token positions to hide
    span: Literal["prompt", "generated", "system", "user"] | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.mask is None) == (self.span is None):
            raise ValueError("mask_positions needs exactly one of `mask` (positions) or `span` "
                             "(prompt|generated|system|user)")
        return self


class PatchResidual(_Entry):
    kind: Literal["patch_residual"]
    layer: int
    source_run: str
    source_sequence: int | None = None  # default: the same sequence index


class PatchHead(_Entry):
    kind: Literal["patch_head"]
    layer: int
    head: int
    source_run: str
    source_sequence: int | None = None  # default: the same sequence index


class MaskExperts(_Entry):
    kind: Literal["mask_experts"]
    layer: int
    experts: list[int] = Field(min_length=1)


class Steer(_Entry):
    kind: Literal["steer"]
    layer: int
    alpha: float
    vector: str | None = None  # .npy file with d_model values
    from_runs: list[str] | None = None  # [A, B]: mean residual at `layer` of run A minus run B

    @model_validator(mode="after")
    def _one(self):
        if (self.vector is None) == (self.from_runs is None):
            raise ValueError("steer needs exactly one of `vector` (.npy file) or `from_runs` ([run_a, run_b])")
        if self.from_runs is not None and len(self.from_runs) != 2:
            raise ValueError("steer.from_runs takes two runs: [A, B] (the direction is mean(A) - mean(B))")
        return self


Entry = Annotated[Union[AblateHead, AblateAttention, AblateMlp, AblateNeurons, AblateLayer, MaskPositions,
                        PatchResidual, PatchHead, Steer, MaskExperts], Field(discriminator="kind")]
KINDS = ("ablate_head", "ablate_attention", "ablate_mlp", "ablate_neurons", "ablate_layer", "mask_positions",
         "patch_residual", "patch_head", "steer", "mask_experts")
_ENTRIES = TypeAdapter(list[Entry])


def parse_entries(data, source: str) -> list[_Entry]:
    try:
        return _ENTRIES.validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"{source}: interventions.{loc}: {first['msg']} (kinds: {', '.join(KINDS)})") from None


def _split_mode(item, flag: str, example: str) -> tuple[str, str]:
    """'7' -> ('7', 'zero'); '7:mean' -> ('7', 'mean'); a trailing ':zero' is accepted too."""
    text = str(item).strip()
    for mode in ("mean", "zero"):
        if text.endswith(":" + mode):
            return text[: -len(mode) - 1], mode
    if ":" in text and text.rsplit(":", 1)[-1].isalpha():
        raise SpecError(f"{flag} {text!r}: the ablation mode after ':' is zero or mean, e.g. {example}")
    return text, "zero"


def shorthand_entries(ablate_head: list[str], ablate_layer: list, ablate_mlp: list, ablate_attn: list,
                      ablate_neurons: list[str], mask_positions: list[str]) -> list[dict]:
    """Turn the CLI's shorthand flags into entry dicts.

    Every ablation flag takes an optional `:mean` suffix (default zero): `--ablate-head 12.3:mean`,
    `--ablate-layer 7:mean`, `--ablate-mlp 7:mean`, `--ablate-attn 4:mean`, `--ablate-neurons 7:120,455:mean`.
    `--mask-positions` takes positions and ranges (`3-9`, `1,4`) or a span name (prompt, generated,
    system, user).
    """
    out: list[dict] = []
    for item in ablate_head:
        text, mode = _split_mode(item, "--ablate-head", "12.3:mean")
        try:
            layer, head = (int(x) for x in text.split("."))
        except ValueError:
            raise SpecError(f"--ablate-head {item!r}: expected LAYER.HEAD[:mean], e.g. 12.3 or 12.3:mean") from None
        out.append({"kind": "ablate_head", "layer": layer, "head": head, "mode": mode})
    for flag, kind, items in (("--ablate-layer", "ablate_layer", ablate_layer), ("--ablate-mlp", "ablate_mlp", ablate_mlp),
                              ("--ablate-attn", "ablate_attention", ablate_attn)):
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
            out.append({"kind": "ablate_neurons", "layer": int(layer),
                        "neurons": parse_range_list(neurons, "--ablate-neurons"), "mode": mode})
        except ValueError:
            raise SpecError(f"--ablate-neurons {item!r}: LAYER must be an integer") from None
    for item in mask_positions:
        if item.strip() in SPANS:
            out.append({"kind": "mask_positions", "span": item.strip()})
        else:
            out.append({"kind": "mask_positions", "mask": parse_range_list(item, "--mask-positions")})
    return out


def validate_against(entries: list[_Entry], n_layers: int, n_heads: int, d_ffn: int, n_sequences: int,
                     n_experts: int | None = None, experts_per_token: int | None = None,
                     model_class: str = "this model") -> None:
    """Out-of-range layers, heads, neurons, experts or sequences are errors naming the valid range."""
    for i, e in enumerate(entries):
        where = f"interventions[{i}] ({e.kind})"
        layer = getattr(e, "layer", None)
        if layer is not None and not 0 <= layer < n_layers:
            raise SpecError(f"{where}: layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        if isinstance(e, (AblateHead, PatchHead)) and not 0 <= e.head < n_heads:
            raise SpecError(f"{where}: head {e.head} is out of range: the model has heads 0..{n_heads - 1}")
        if isinstance(e, AblateNeurons):
            bad = [n for n in e.neurons if not 0 <= n < d_ffn]
            if bad:
                raise SpecError(f"{where}: neurons {bad[:5]} out of range: the MLP has neurons 0..{d_ffn - 1}")
        if isinstance(e, MaskExperts):
            if not n_experts:
                raise SpecError(f"{where}: {model_class} has no mixture-of-experts router; expert masking needs a "
                                f"MoE model (mixtral, qwen2_moe, gpt_oss)")
            bad = [x for x in e.experts if not 0 <= x < n_experts]
            if bad:
                raise SpecError(f"{where}: experts {bad[:5]} out of range: the model has experts 0..{n_experts - 1}")
            left = n_experts - len(set(e.experts))
            if experts_per_token and left < experts_per_token:
                raise SpecError(f"{where}: masking {len(set(e.experts))} of {n_experts} experts leaves {left}, fewer "
                                f"than the {experts_per_token} the router picks per token; mask at most "
                                f"{n_experts - experts_per_token}")
        if e.sequences != "all":
            bad = [s for s in e.sequences if not 0 <= s < n_sequences]
            if bad:
                raise SpecError(f"{where}: sequences {bad} out of range: the run has sequences 0..{n_sequences - 1}")


def _row_mask(sel: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sel [B, q] -> a mask broadcastable to x: [B, q, 1], or [B*q, 1] for modules that see
    flattened tokens (OPT's fc1/fc2)."""
    return sel.reshape(-1, 1) if x.dim() == 2 else sel[..., None]


def _replace_first(output, value):
    if isinstance(output, tuple):
        return (value, *output[1:])
    return value


class EditSet:
    """The tracer's `Edits`: installs one hook per entry and knows which rows/positions are active.

    Hooks are registered with `prepend=True`, so they run before the capture hooks of the probes:
    the child's archive records the edited values (an ablated block's norm, the masked router choice).
    """

    def __init__(self, entries: list[_Entry], adapter, prompt_len: dict[int, int], resources: dict):
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

    def _selected(self, entry: _Entry) -> torch.Tensor | None:
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
            yield self
        finally:
            for h in handles:
                h.remove()

    def _install(self, i: int, e: _Entry) -> list:
        a = self.adapter
        mean = self.resources.get(i) if isinstance(e, _Ablation) and e.mode == "mean" else None
        if isinstance(e, _Ablation) and e.mode == "mean" and mean is None:
            raise RuntimeError(f"interventions[{i}] ({e.kind}): mean values were not computed")
        if isinstance(e, AblateHead):
            d = a.head_dim
            lo, hi = e.head * d, (e.head + 1) * d

            def head_hook(module, args):
                sel = self._selected(e)
                if sel is None:
                    return None
                x = args[0].clone()
                value = torch.zeros((), dtype=x.dtype, device=x.device) if mean is None else mean.to(x.device, x.dtype)
                x[..., lo:hi] = torch.where(_row_mask(sel, x), value, x[..., lo:hi])
                return (x, *args[1:])
            return [a.o_proj(e.layer).register_forward_pre_hook(head_hook, prepend=True)]
        if isinstance(e, (AblateAttention, AblateMlp)):
            module = a.attn(e.layer) if isinstance(e, AblateAttention) else a.mlp(e.layer)

            def block_out(module, args, kwargs, output):
                sel = self._selected(e)
                if sel is None:
                    return None
                first = output[0] if isinstance(output, tuple) else output
                rows = _row_mask(sel, first)
                value = first.masked_fill(rows, 0.0) if mean is None else torch.where(
                    rows, mean.to(first.device, first.dtype), first)
                return _replace_first(output, value)
            return [tap(module, block_out, prepend=True)]
        if isinstance(e, AblateNeurons):
            if self.adapter.family.mlp_down is None:
                raise SpecError(f"ablate_neurons: {self.adapter.family.name} models have no single MLP "
                                f"down-projection (experts are fused); ablate the MLP block or a layer instead")
            idx = torch.tensor(e.neurons)

            def neuron_hook(module, args):
                sel = self._selected(e)
                if sel is None:
                    return None
                x = args[0].clone()
                cols = idx.to(x.device)
                current = x[..., cols]
                rows = _row_mask(sel, x)
                x[..., cols] = current.masked_fill(rows, 0.0) if mean is None else torch.where(
                    rows, mean[idx].to(x.device, x.dtype), current)
                return (x, *args[1:])
            return [a.mlp_down(e.layer).register_forward_pre_hook(neuron_hook, prepend=True)]
        if isinstance(e, AblateLayer):
            def skip(module, args, kwargs, output):
                sel = self._selected(e)
                if sel is None:
                    return None
                out = output[0] if isinstance(output, tuple) else output
                x = args[0] if args else kwargs["hidden_states"]  # the block's input
                if mean is not None:
                    x = x + mean.to(out.device, out.dtype)
                return _replace_first(output, torch.where(sel[..., None], x, out))
            return [tap(a.layers[e.layer], skip, prepend=True)]
        if isinstance(e, PatchHead):
            d = a.head_dim
            lo, hi = e.head * d, (e.head + 1) * d
            source = self.resources[i]

            def patch_head_hook(module, args):
                sel = self._selected(e)
                if sel is None:
                    return None
                x = args[0].clone()
                for b, seq in enumerate(self.seq_ids):
                    if sel[b, -1]:  # the query position; the source holds one value per step
                        v = source(seq, self.step)
                        if v is not None:
                            x[b, -1, lo:hi] = v.to(x.device, x.dtype)
                return (x, *args[1:])
            return [a.o_proj(e.layer).register_forward_pre_hook(patch_head_hook, prepend=True)]
        if isinstance(e, MaskExperts):
            rule = self.resources[i]
            experts = torch.tensor(sorted(set(e.experts)))

            def expert_hook(module, args, kwargs, output):
                sel = self._selected(e)
                if sel is None:
                    return None
                logits, weights, chosen = output
                rows = sel.reshape(-1, 1)  # the router sees the [B, q] tokens flattened
                cols = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                cols[experts.to(logits.device)] = True
                masked = logits.masked_fill(rows & cols, float("-inf"))
                new_weights, new_chosen = rule(module, masked)
                return (masked, torch.where(rows, new_weights.to(weights.dtype), weights),
                        torch.where(rows, new_chosen, chosen))
            return [tap(a.routers[e.layer], expert_hook, prepend=True)]
        if isinstance(e, (PatchResidual, Steer)):
            resource = self.resources[i]

            def residual_hook(module, args, kwargs, output):
                sel = self._selected(e)
                if sel is None:
                    return None
                out = (output[0] if isinstance(output, tuple) else output).clone()
                if isinstance(e, Steer):
                    v = resource.to(out.dtype).to(out.device)
                    out = torch.where(sel[..., None], out + e.alpha * v, out)
                else:  # only the query position's residual is archived, so only it is patched
                    for b, seq in enumerate(self.seq_ids):
                        if sel[b, -1]:
                            src = resource(seq, self.step)
                            if src is not None:
                                out[b, -1] = torch.as_tensor(src, dtype=out.dtype, device=out.device)
                return _replace_first(output, out)
            return [tap(a.layers[e.layer], residual_hook, prepend=True)]
        return []  # mask_positions works through edit_mask


# --- mean values ------------------------------------------------------------------------------
MEAN_COMPONENT = {"ablate_head": "head", "ablate_attention": "attn", "ablate_mlp": "mlp", "ablate_neurons": "ffn",
                  "ablate_layer": "layer"}


@torch.inference_mode()
def component_means(adapter, sequences: list[list[int]], wanted: set[tuple[str, int]]) -> dict[tuple[str, int], torch.Tensor]:
    """Mean of each wanted (component, layer) over every token position of every sequence.

    Each sequence (a parent's prompt + generated ids) runs alone in one forward of the unedited model,
    so there is no padding. Components: head (the output projection's input, all heads; slice it),
    attn (attention block output), mlp (MLP block output), ffn (the down projection's input: every
    neuron), layer (the block's residual contribution: output - input). Sums are float64.
    """
    model = adapter.model
    sums: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[tuple[str, int], int] = {}

    def add(key, x):
        x = x.reshape(-1, x.shape[-1]).double()
        sums[key] = sums[key] + x.sum(0) if key in sums else x.sum(0)
        counts[key] = counts.get(key, 0) + x.shape[0]

    def first(output):
        return output[0] if isinstance(output, tuple) else output

    handles = []
    try:
        for kind, layer in sorted(wanted):
            key = (kind, layer)
            if kind == "head":
                handles.append(adapter.o_proj(layer).register_forward_pre_hook(lambda m, a, key=key: add(key, a[0])))
            elif kind == "attn":
                handles.append(adapter.attn(layer).register_forward_hook(lambda m, a, o, key=key: add(key, first(o))))
            elif kind == "mlp":
                handles.append(adapter.mlp(layer).register_forward_hook(lambda m, a, o, key=key: add(key, first(o))))
            elif kind == "ffn":
                handles.append(adapter.mlp_down(layer).register_forward_pre_hook(lambda m, a, key=key: add(key, a[0])))
            elif kind == "layer":
                saved = {}
                block = adapter.layers[layer]
                handles.append(block.register_forward_pre_hook(
                    lambda m, a, k, saved=saved: saved.__setitem__("x", a[0] if a else k["hidden_states"]),
                    with_kwargs=True))
                handles.append(block.register_forward_hook(
                    lambda m, a, o, key=key, saved=saved: add(key, first(o) - saved["x"])))
        device = next(model.parameters()).device
        for ids in sequences:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {key: (sums[key] / counts[key]) for key in sums}


def mean_ablation_values(entries: list, adapter, sequences, note=None) -> dict[int, torch.Tensor]:
    """For each mean-ablation entry (by index): the value it puts in place of its component, the
    component's mean over `sequences()` (`component_means`; a head's own slice for ablate_head).

    `sequences` is called only when some entry needs a mean; `note(text)` is told before the forwards."""
    wanted = {(MEAN_COMPONENT[e.kind], e.layer) for e in entries if isinstance(e, _Ablation) and e.mode == "mean"}
    if not wanted:
        return {}
    seqs = sequences()
    if note is not None:
        note(f"mean values: one forward over each of the parent's {len(seqs)} sequences")
    means = component_means(adapter, seqs, wanted)
    out = {}
    for i, e in enumerate(entries):
        if isinstance(e, _Ablation) and e.mode == "mean":
            mean = means[(MEAN_COMPONENT[e.kind], e.layer)]
            if isinstance(e, AblateHead):
                mean = mean[e.head * adapter.head_dim: (e.head + 1) * adapter.head_dim]
            out[i] = mean
    return out


# --- MoE routing --------------------------------------------------------------------------------
def _route_mixtral(router, logits):
    """MixtralTopKRouter: softmax (float32) -> top-k -> renormalise the k weights."""
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    value, index = torch.topk(probs, router.top_k, dim=-1)
    return value / value.sum(dim=-1, keepdim=True), index


def _route_qwen2_moe(router, logits):
    """Qwen2MoeTopKRouter: softmax (float32) -> top-k -> renormalise only if norm_topk_prob; logits' dtype."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    value, index = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        value = value / value.sum(dim=-1, keepdim=True)
    return value.to(logits.dtype), index


def _route_gpt_oss(router, logits):
    """GptOssTopKRouter: top-k of the logits -> softmax over those k."""
    value, index = torch.topk(logits, router.top_k, dim=-1)
    return torch.nn.functional.softmax(value, dim=1, dtype=value.dtype), index


ROUTING_RULES = {"MixtralTopKRouter": _route_mixtral, "Qwen2MoeTopKRouter": _route_qwen2_moe,
                 "GptOssTopKRouter": _route_gpt_oss}


@torch.inference_mode()
def routing_rule(adapter, layer: int, where: str):
    """The routing rule of block `layer`'s router, checked to reproduce the router's own output."""
    router = adapter.routers[layer]
    if router is None:
        with_router = [i for i, r in enumerate(adapter.routers) if r is not None]
        raise SpecError(f"{where}: layer {layer} of {type(adapter.model).__name__} is a dense layer without a router; "
                        f"layers with experts: {', '.join(map(str, with_router)) or 'none'}")
    name = type(router).__name__
    rule = ROUTING_RULES.get(name)
    if rule is None:
        raise UnsupportedArchitectureError(
            f"{where}: expert masking is not supported for router {name}; supported routers: {', '.join(ROUTING_RULES)}")
    weight = router.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(7, weight.shape[1], generator=g).to(weight.device, weight.dtype)
    logits, weights, chosen = router(h)
    w2, c2 = rule(router, logits)
    if not (torch.equal(c2, chosen) and torch.equal(w2.to(weights.dtype), weights)):
        raise UnsupportedArchitectureError(
            f"{where}: router {name} no longer computes the routing rule lmtrace re-applies after masking "
            f"(installed transformers differs); expert masking is unsupported with this version")
    return rule


def load_steer_vector(e: Steer, d_model: int, open_run) -> torch.Tensor:
    if e.vector is not None:
        path = Path(e.vector)
        if not path.is_file():
            raise SpecError(f"steer.vector: {path} does not exist")
        v = np.load(path)
    else:
        means = []
        for ref in e.from_runs:
            r = open_run(ref)
            if "resid" not in r.array_names() or e.layer not in r.shape["resid_layers"]:
                raise SpecError(f"steer.from_runs: run {r.id} has no residual vectors at layer {e.layer} "
                                f"(set capture.residual.vectors_at to include {e.layer})")
            ri = r.shape["resid_layers"].index(e.layer)
            arr = r.array("resid")[:, :, ri]
            means.append(np.nanmean(arr.reshape(-1, arr.shape[-1]), axis=0))
        v = means[0] - means[1]
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    if v.shape[0] != d_model:
        raise SpecError(f"steer vector has {v.shape[0]} values; the model's residual stream has {d_model}")
    return torch.from_numpy(v)


def patch_source(e: PatchResidual, open_run):
    """(sequence, step) -> archived residual vector after e.layer at that step's query position."""
    src = open_run(e.source_run)
    if "resid" not in src.array_names() or e.layer not in src.shape["resid_layers"]:
        raise SpecError(f"patch_residual: source run {src.id} has no residual vectors at layer {e.layer}; "
                        f"rerun it with capture.residual.vectors_at including {e.layer}")
    ri = src.shape["resid_layers"].index(e.layer)
    arr = src.array("resid")
    lengths = src.generated_len()

    def get(seq: int, step: int):
        s = e.source_sequence if e.source_sequence is not None else seq
        if s >= arr.shape[0] or step >= lengths[s]:
            return None
        return np.asarray(arr[s, step, ri], dtype=np.float32)  # float16 in runs of the default capture
    return get
