"""The KV-cached generation loop: prefill, decode steps, probes, stop conditions, batching.

One prefill call over the left-padded batch, then one decode call per token with the growing
attention mask and explicit position ids (cumsum(mask) - 1), so every row sees exactly what it
would see alone. Step s is the forward call that chooses generated token s; step 0 is the prefill.
The cache is lmtrace's `StackedCache` (lmtrace/capture/kv_cache.py): DynamicCache's values, appended in place.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from .kv_cache import StackedCache
from .probes import ForwardContext, Probes
from .sampling import Choice, Sampler, choose, uniforms


@dataclass
class StepResult:
    step: int
    active: np.ndarray  # [B] bool: rows that chose a token at this step
    choice: Choice
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # per-step tensors [B, ...]
    scalars: dict[str, np.ndarray] = field(default_factory=dict)  # per-layer scalars [B, layer]
    prompt_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # only at step 0
    finished_now: np.ndarray | None = None  # [B] bool: rows whose last token this was
    eos_now: np.ndarray | None = None  # [B] bool: rows that chose an eos token at this step
    seq_ids: list[int] = field(default_factory=list)  # global sequence index of each row


class StepSink(Protocol):
    def on_step(self, result: StepResult) -> None: ...


class Teacher(Protocol):
    """Drives a replay (intervene): which tokens are forced, which reference ids to score."""

    def forced(self, seq_ids: list[int], step: int) -> list[int]: ...  # -1 = choose freely

    def reference(self, seq_ids: list[int], step: int) -> list[list[int]]: ...  # [B, r], -1 = none


class Edits(Protocol):
    """Interventions: hooks that change the forward, and edits of the attention mask."""

    def attached(self): ...  # context manager installing the hooks

    def begin(self, step: int, seq_ids: list[int], positions: torch.Tensor, prefill: bool) -> None: ...

    def edit_mask(self, mask: torch.Tensor, pads: list[int], seq_ids: list[int], step: int) -> torch.Tensor: ...


class ForcedTokens:
    """A Teacher that forces archived tokens at steps < upto (no references): resume rebuilds its
    cache this way, and patch_head replays a source run with upto = every step."""

    def __init__(self, tokens, upto: int | float = float("inf")):  # tokens[sequence index] -> ids (dict or list)
        self.tokens = tokens
        self.upto = upto

    def forced(self, seq_ids, step):
        return [self.tokens[s][step] if step < self.upto and step < len(self.tokens[s]) else -1 for s in seq_ids]

    def reference(self, seq_ids, step):
        return [[-1] for _ in seq_ids]


@dataclass
class BatchOutcome:
    generated: list[list[int]]
    stop_reason: list[str]
    interrupted: bool = False

    @classmethod
    def interrupted_at(cls, generated: list[list[int]], stop_reason: list[str], active: np.ndarray) -> BatchOutcome:
        """The outcome of a batch stopped on request: rows still active [B] stop as "interrupted"."""
        return cls(generated, ["interrupted" if a else r for a, r in zip(active, stop_reason)], True)


class Tracer:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        sampler: Sampler,
        seed: int,
        max_new_tokens: int,
        eos_ids: set[int],
        stop_strings: list[str],
        n_alternatives: int,
        probes: Probes | None,
        pad_id: int,
        device: torch.device,
        layer_devices: list[torch.device] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.stop_strings = stop_strings
        self.stop_window = max((len(s) for s in stop_strings), default=0) + 8
        self.n_alternatives = n_alternatives
        self.probes = probes
        self.pad_id = pad_id
        self.device = device  # where the inputs go: the input embedding's device
        self.layer_devices = layer_devices  # each layer's attention device, for a model spread over several
        self.generator = torch.Generator(device="cpu")

    def _prefill_inputs(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], StackedCache]:
        """The prefill's inputs on the input device: ids, attention mask and position ids [B, T] of the
        prompts left-padded to the longest (T), each row's padding, and the batch's empty KV cache."""
        B = len(prompts)
        T = max(len(p) for p in prompts)
        pads = [T - len(p) for p in prompts]
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, pads[b] :] = torch.tensor(p, dtype=torch.long)
            mask[b, pads[b] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = StackedCache.for_generation(self.model.config, T, self.max_new_tokens, ids.device, self.layer_devices)
        return ids, mask, positions, pads, cache

    @contextmanager
    def _hooks(self, edits: Edits | None):
        """The probes' taps and the edits' hooks, attached for one batch (each only when there is one)."""
        context = self.probes.attached() if self.probes is not None else nullcontext()
        edit_context = edits.attached() if edits is not None else nullcontext()
        with context, edit_context:
            yield

    def _hit_stop_string(self, tokens: list[int]) -> bool:
        if not self.stop_strings:
            return False
        tail = self.tokenizer.decode(tokens[-self.stop_window :], skip_special_tokens=False)
        return any(s in tail for s in self.stop_strings)

    @torch.inference_mode()
    def run_batch(
        self,
        seq_ids: list[int],
        prompts: list[list[int]],
        sink: StepSink,
        should_stop: Callable[[], bool] = lambda: False,
        teacher: Teacher | None = None,
        edits: Edits | None = None,
        forward_running=None,
    ) -> BatchOutcome:
        """Generate for one batch of tokenised prompts. seq_ids are global sequence indices (seeding).

        forward_running: a context manager entered around each model forward (the archive writer
        pauses inside it: BackgroundWriter.forward_running).
        """
        B = len(prompts)
        ids, mask, positions, pads, cache = self._prefill_inputs(prompts)
        total = ids.shape[1]  # the padded context length
        generated: list[list[int]] = [[] for _ in range(B)]
        stop_reason = ["max_new_tokens"] * B
        active = np.ones(B, dtype=bool)
        probes = self.probes
        in_forward = forward_running if forward_running is not None else nullcontext()
        with self._hooks(edits):
            for step in range(self.max_new_tokens):
                if probes is not None:
                    probes.begin(ForwardContext(pads=pads, total_len=total, prefill=step == 0, kv=cache.stack))
                model_mask = mask
                if edits is not None:
                    edits.begin(step, seq_ids, positions, step == 0)
                    model_mask = edits.edit_mask(mask, pads, seq_ids, step)
                with in_forward:
                    out = self.model(
                        input_ids=ids,
                        attention_mask=model_mask,
                        position_ids=positions,
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                logits = out.logits[:, -1].float()
                u = None if self.sampler.greedy else uniforms(self.generator, self.seed, seq_ids, step)
                forced = ref = None
                if teacher is not None:
                    forced = torch.tensor(teacher.forced(seq_ids, step), dtype=torch.long)
                    ref = torch.tensor(teacher.reference(seq_ids, step), dtype=torch.long)
                choice = choose(logits, self.sampler, u, self.n_alternatives, forced=forced, ref_ids=ref)
                result = StepResult(step=step, active=active.copy(), choice=choice, seq_ids=seq_ids)
                if probes is not None:
                    result.arrays, result.scalars = probes.collect(logits, choice)
                    if step == 0:
                        result.prompt_arrays = probes.collect_prefill()
                tokens = choice.token.tolist()
                finished_now = np.zeros(B, dtype=bool)
                eos_now = np.zeros(B, dtype=bool)
                for b in range(B):
                    if not active[b]:
                        continue
                    generated[b].append(tokens[b])
                    if tokens[b] in self.eos_ids:
                        stop_reason[b], finished_now[b], eos_now[b] = "eos", True, True
                    elif self._hit_stop_string(generated[b]):
                        stop_reason[b], finished_now[b] = "stop_string", True
                result.finished_now, result.eos_now = finished_now, eos_now
                sink.on_step(result)
                active &= ~finished_now
                if not active.any() or step + 1 == self.max_new_tokens:
                    break
                if should_stop():
                    return BatchOutcome.interrupted_at(generated, stop_reason, active)
                # Finished rows keep decoding a pad token (their results are discarded); rows are
                # independent, so this changes nothing for the others.
                next_ids = torch.tensor([t if a else self.pad_id for t, a in zip(tokens, active)], dtype=torch.long)
                ids = next_ids[:, None].to(self.device)
                mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], dim=1)
                positions = positions[:, -1:] + 1
                total += 1
        return BatchOutcome(generated, stop_reason)
