"""The target quantity f of one step (chosen / runner-up / contrast, as logit or logprob at the last
context position) and `Scorer`: a loaded float32 model as the function f(input embeddings), with an
intervention child's edits installed when it has them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .registry import StepContext
    from .replay import ContextEdits


def target_values(logits: torch.Tensor, chosen: int, runner_up: int, target: str, quantity: str) -> torch.Tensor:
    """[B, vocab] logits of the last position -> [B] target quantity f."""
    values = logits.double() if logits.dtype == torch.float64 else logits.float()
    if quantity == "logprob":
        values = values.log_softmax(-1)
    if target == "chosen":
        return values[:, chosen]
    if target == "runner-up":
        return values[:, runner_up]
    return values[:, chosen] - values[:, runner_up]


class Scorer:
    """A float32 model and the target function f(embeddings) of one step's last position."""

    def __init__(self, model: torch.nn.Module, device: torch.device, tokenizer=None):
        self.model = model
        self.device = device
        self.embed = model.get_input_embeddings()
        self.tokenizer = tokenizer
        self.pad_id = getattr(tokenizer, "pad_token_id", None)
        self.edits: "ContextEdits | None" = None  # an intervention child's edits, installed while explaining it
        self._mean: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def of(cls, loaded) -> "Scorer":
        """The scorer of a model loaded by `models.load_run_model` (its model, device and tokenizer)."""
        return cls(loaded.model, loaded.device, loaded.tokenizer)

    def embeddings(self, ids: list[int]) -> torch.Tensor:
        """ids [n] -> [n, d] the embedding module's output (what the model's first layer receives)."""
        with torch.no_grad():
            return self.embed(torch.tensor([ids], device=self.device))[0].float().detach()

    def mean_embedding(self, dtype: torch.dtype = torch.float32, chunk: int = 4096) -> torch.Tensor:
        """[d] the mean of the embedding module's output over every token id of the vocabulary: the mean row of
        the embedding matrix as the model's first layer receives it, on the inputs' scale (Gemma multiplies by
        √d_model inside its embedding module). Summed in float64 in chunks of ids; cached per model dtype."""
        key = self.embed.weight.dtype
        if key not in self._mean:
            vocab = self.embed.weight.shape[0]
            total = torch.zeros(self.embed.weight.shape[1], dtype=torch.float64, device=self.device)
            with torch.no_grad():
                for lo in range(0, vocab, chunk):
                    ids = torch.arange(lo, min(lo + chunk, vocab), device=self.device)
                    total += self.embed(ids[None])[0].double().sum(0)
            self._mean[key] = total / vocab
        return self._mean[key].to(dtype)

    def logits(self, embeds: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [B, n, d] (mask [B, n], 1 = attend) -> last-position logits [B, vocab]."""
        B, n, _ = embeds.shape
        if mask is None:
            mask = torch.ones((B, n), dtype=torch.long, device=self.device)
        if self.edits is not None:
            self.edits.begin_forward(B, n, self.device)
            mask = self.edits.mask(mask)
        positions = torch.arange(n, device=self.device)[None].expand(B, n)
        out = self.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1
        )
        return out.logits[:, -1]

    def f(self, ctx: "StepContext", embeds: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [B, n, d] -> [B] the step's target quantity."""
        s = ctx.settings
        return target_values(self.logits(embeds, mask), ctx.chosen_id, ctx.runner_up_id, s.target, s.quantity)
