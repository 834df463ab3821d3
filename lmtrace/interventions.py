"""Interventions as data: typed entries (where + when), validated against a model, installed as hooks.

Every kind edits the real forward pass; nothing perturbs logits after the fact. An edit active at
step s applies to the positions the forward computes at that step (all prompt positions at the
prefill, the query position afterwards); K/V cached at earlier steps keep the values they had.

Kinds (registry `KINDS`, each writable in YAML and stored in the child's manifest):
  ablate_head       zero or mean: the head's slice of the output projection's input
  ablate_attention  zero the attention block's output
  ablate_mlp        zero the MLP block's output
  ablate_neurons    zero chosen neurons of the MLP intermediate activation
  ablate_layer      skip the layer: its output is its input (no residual contribution)
  mask_positions    hide token positions from every query through the attention mask
  patch_residual    replace the residual after a layer at the query position with another run's archived vector
  steer             add alpha * v to the residual after a layer
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from .errors import SpecError


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


class AblateHead(_Entry):
    kind: Literal["ablate_head"]
    layer: int
    head: int
    mode: Literal["zero", "mean"] = "zero"


class AblateAttention(_Entry):
    kind: Literal["ablate_attention"]
    layer: int


class AblateMlp(_Entry):
    kind: Literal["ablate_mlp"]
    layer: int


class AblateNeurons(_Entry):
    kind: Literal["ablate_neurons"]
    layer: int
    neurons: list[int] = Field(min_length=1)


class AblateLayer(_Entry):
    kind: Literal["ablate_layer"]
    layer: int


class MaskPositions(_Entry):
    kind: Literal["mask_positions"]
    mask: list[int] | None = None  # token positions to hide
    span: Literal["prompt", "generated"] | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.mask is None) == (self.span is None):
            raise ValueError("mask_positions needs exactly one of `mask` (positions) or `span` (prompt|generated)")
        return self


class PatchResidual(_Entry):
    kind: Literal["patch_residual"]
    layer: int
    source_run: str
    source_sequence: int | None = None  # default: the same sequence index


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
                        PatchResidual, Steer], Field(discriminator="kind")]
KINDS = ("ablate_head", "ablate_attention", "ablate_mlp", "ablate_neurons", "ablate_layer", "mask_positions",
         "patch_residual", "steer")
_ENTRIES = TypeAdapter(list[Entry])


def parse_entries(data, source: str) -> list[_Entry]:
    try:
        return _ENTRIES.validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"{source}: interventions.{loc}: {first['msg']} (kinds: {', '.join(KINDS)})") from None


def parse_range_list(text: str, what: str) -> list[int]:
    """'3-9' or '3,5,7-8' -> [3, 4, ..., 9] (inclusive ranges)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise SpecError(f"{what}: {text!r} is not a list of integers or ranges like 3-9") from None
    return out


def shorthand_entries(ablate_head: list[str], ablate_layer: list[int], ablate_mlp: list[int], ablate_attn: list[int],
                      ablate_neurons: list[str], mask_positions: list[str]) -> list[dict]:
    """Turn the CLI's shorthand flags into entry dicts."""
    out: list[dict] = []
    for item in ablate_head:
        try:
            layer, head = (int(x) for x in item.split("."))
        except ValueError:
            raise SpecError(f"--ablate-head {item!r}: expected LAYER.HEAD, e.g. 12.3") from None
        out.append({"kind": "ablate_head", "layer": layer, "head": head})
    out += [{"kind": "ablate_layer", "layer": i} for i in ablate_layer]
    out += [{"kind": "ablate_mlp", "layer": i} for i in ablate_mlp]
    out += [{"kind": "ablate_attention", "layer": i} for i in ablate_attn]
    for item in ablate_neurons:
        if ":" not in item:
            raise SpecError(f"--ablate-neurons {item!r}: expected LAYER:N1,N2,..., e.g. 7:120,455")
        layer, neurons = item.split(":", 1)
        try:
            out.append({"kind": "ablate_neurons", "layer": int(layer),
                        "neurons": parse_range_list(neurons, "--ablate-neurons")})
        except ValueError:
            raise SpecError(f"--ablate-neurons {item!r}: LAYER must be an integer") from None
    for item in mask_positions:
        out.append({"kind": "mask_positions", "mask": parse_range_list(item, "--mask-positions")})
    return out


def validate_against(entries: list[_Entry], n_layers: int, n_heads: int, d_ffn: int, n_sequences: int) -> None:
    """Out-of-range layers, heads, neurons or sequences are errors naming the valid range."""
    for i, e in enumerate(entries):
        where = f"interventions[{i}] ({e.kind})"
        layer = getattr(e, "layer", None)
        if layer is not None and not 0 <= layer < n_layers:
            raise SpecError(f"{where}: layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        if isinstance(e, AblateHead) and not 0 <= e.head < n_heads:
            raise SpecError(f"{where}: head {e.head} is out of range: the model has heads 0..{n_heads - 1}")
        if isinstance(e, AblateNeurons):
            bad = [n for n in e.neurons if not 0 <= n < d_ffn]
            if bad:
                raise SpecError(f"{where}: neurons {bad[:5]} out of range: the MLP has neurons 0..{d_ffn - 1}")
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
    """The tracer's `Edits`: installs one hook per entry and knows which rows/positions are active."""

    def __init__(self, entries: list[_Entry], adapter, prompt_len: dict[int, int], resources: dict):
        self.entries = entries
        self.adapter = adapter
        self.prompt_len = prompt_len  # sequence -> prompt length
        self.resources = resources  # entry index -> tensor (mean head output, patch source, steer vector)
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

    def edit_mask(self, mask: torch.Tensor, pads: list[int], seq_ids: list[int], step: int) -> torch.Tensor:
        edited = None
        for e in self.entries:
            if not isinstance(e, MaskPositions) or not e.active_at(step):
                continue
            for b, seq in enumerate(seq_ids):
                if e.sequences != "all" and seq not in e.sequences:
                    continue
                n_ctx = mask.shape[1] - pads[b]
                plen = self.prompt_len[seq]
                hidden = range(plen) if e.span == "prompt" else range(plen, n_ctx) if e.span == "generated" else e.mask
                cols = [pads[b] + p for p in hidden if 0 <= p < n_ctx]
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
        if isinstance(e, AblateHead):
            d = a.head_dim
            lo, hi = e.head * d, (e.head + 1) * d
            mean = self.resources.get(i)

            def head_hook(module, args):
                sel = self._selected(e)
                if sel is None:
                    return None
                x = args[0].clone()
                value = torch.zeros((), dtype=x.dtype, device=x.device) if mean is None else mean.to(x.dtype)
                x[..., lo:hi] = torch.where(sel[..., None], value, x[..., lo:hi])
                return (x, *args[1:])
            return [a.o_proj(e.layer).register_forward_pre_hook(head_hook)]
        if isinstance(e, (AblateAttention, AblateMlp)):
            module = a.attn(e.layer) if isinstance(e, AblateAttention) else a.mlp(e.layer)

            def zero_out(module, args, output):
                sel = self._selected(e)
                if sel is None:
                    return None
                first = output[0] if isinstance(output, tuple) else output
                return _replace_first(output, first.masked_fill(_row_mask(sel, first), 0.0))
            return [module.register_forward_hook(zero_out)]
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
                cols = x[..., idx.to(x.device)]
                x[..., idx.to(x.device)] = cols.masked_fill(_row_mask(sel, x), 0.0)
                return (x, *args[1:])
            return [a.mlp_down(e.layer).register_forward_pre_hook(neuron_hook)]
        if isinstance(e, AblateLayer):
            saved = {}

            def keep_input(module, args, kwargs):
                saved["x"] = args[0] if args else kwargs["hidden_states"]

            def skip(module, args, output):
                sel = self._selected(e)
                if sel is None:
                    return None
                out = output[0] if isinstance(output, tuple) else output
                return _replace_first(output, torch.where(sel[..., None], saved["x"], out))
            block = a.layers[e.layer]
            return [block.register_forward_pre_hook(keep_input, with_kwargs=True), block.register_forward_hook(skip)]
        if isinstance(e, (PatchResidual, Steer)):
            resource = self.resources[i]

            def residual_hook(module, args, output):
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
            return [a.layers[e.layer].register_forward_hook(residual_hook)]
        return []  # mask_positions works through edit_mask


def head_output_mean(run, layer: int, head: int) -> torch.Tensor:
    """Mean output of one head over every archived step of `run`: sum_k attn[h, k] * V[kv(h), k]."""
    names = run.array_names()
    if "attn" not in names or "v" not in names or "prompt_v" not in names:
        raise SpecError(f"mean ablation of head {layer}.{head} needs the parent's full attention rows and V "
                        f"(capture.attention with top_k null and capture.qkv); run {run.id} lacks them; use mode: zero")
    li = run.layer_index(layer)
    kv = int(run.tensors["kv_head_of_head"][head])
    P, n = run.prompt_len(), run.generated_len()
    total, count = None, 0
    for seq in range(len(P)):
        p, g = int(P[seq]), int(n[seq])
        if g <= 0:
            continue
        attn = run.array("attn")[seq, :g, li, head].astype(np.float64)  # [g, key]
        values = np.concatenate([run.array("prompt_v")[seq, li, kv, :p], run.array("v")[seq, 1:g, li, kv]], 0).astype(np.float64)
        out = np.nan_to_num(attn[:, : p + g - 1]) @ values  # [g, head_dim]
        total = out.sum(0) if total is None else total + out.sum(0)
        count += g
    return torch.tensor(total / count, dtype=torch.float32)


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
        return arr[s, step, ri]
    return get
