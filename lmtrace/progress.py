"""Progress callbacks: how a long-running command tells the CLI what it is doing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Progress:
    """Callbacks the CLI uses to show progress; all optional."""

    start: Callable[[int, int], None] = lambda n_prompts, max_tokens: None
    advance: Callable[[int], None] = lambda tokens: None
    message: Callable[[str], None] = lambda text: None
    sequences_done: Callable[[int], None] = lambda n: None  # a batch of n sequences finished (or was already)
