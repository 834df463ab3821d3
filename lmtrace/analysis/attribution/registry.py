"""The attribution-method registry: what a method is given (`StepContext`), what it returns
(`MethodResult`), `register` (each method module registers itself when imported, as Inseq's
methods do) and `parse_methods` (names and aliases of `--method`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...archive.reader import Run
from ...exits.errors import SpecError
from .settings import Settings

if TYPE_CHECKING:
    from .targets import Scorer


@dataclass
class StepContext:
    """Everything one method needs to explain one (sequence, step)."""

    run: Run
    sequence: int
    step: int
    prompt_len: int
    ids: list[int]  # the context: prompt ids + generated ids of steps < step
    chosen_id: int  # the token chosen at `step`
    runner_up_id: int  # the most likely archived alternative other than the chosen token
    archived_logprob: float
    settings: Settings
    scorer: "Scorer | None" = None

    @property
    def n(self) -> int:
        return len(self.ids)


@dataclass
class MethodResult:
    scores: np.ndarray  # [n] float32, one per context position
    info: dict = field(default_factory=dict)  # scalars recorded in the manifest (f values, errors, ...)
    components: dict[str, np.ndarray] = field(default_factory=dict)  # per-component relevance (lrp: [layer],
    #                                                                  [layer, head]), archived beside the scores
    latents: dict[str, np.ndarray] = field(default_factory=dict)  # attribution to an SAE (`feature_nodes`): ids,
    #                                            scores [n, top] of the top latents per position, error, inputs [n]


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable[[StepContext], MethodResult]
    needs_model: bool
    description: str
    settings: Callable[[Settings], dict]  # the settings that define its result (recorded in the manifest)
    requirements: Callable[[Run], list[str]] | None = None  # archived data it needs: list of what is missing
    check: Callable[[Run, Settings], None] | None = None  # refuses (SpecError) what it cannot explain, before loading
    # the method's own check of a result (IG: completeness; lrp: conservation): None if it passed, else what
    # failed, as a clause after the method's name ("did not converge: ...")
    shortfall: Callable[[dict, Settings], str | None] | None = None

    def failed_check(self, info: dict, settings: Settings) -> str | None:
        """What the method's own check of a result (its `info`) found wrong, or None (passed, or no check)."""
        return self.shortfall(info, settings) if self.shortfall is not None else None


METHODS: dict[str, Method] = {}
ALIASES = {"gxi": "grad_x_input", "ig": "integrated_gradients", "rollout": "attention_rollout"}


def register(
    name: str,
    *,
    needs_model: bool,
    description: str,
    settings: Callable[[Settings], dict] | None = None,
    requirements: Callable[[Run], list[str]] | None = None,
    check: Callable[[Run, Settings], None] | None = None,
    shortfall: Callable[[dict, Settings], str | None] | None = None,
):
    """Add an attribution method: `fn(ctx: StepContext) -> MethodResult` with one score per context position;
    `shortfall(info, settings)` is its own check of a result (None: passed)."""

    def wrap(fn):
        METHODS[name] = Method(
            name,
            fn,
            needs_model,
            description,
            settings or (lambda s: {"target": s.target, "quantity": s.quantity}),
            requirements,
            check,
            shortfall,
        )
        return fn

    return wrap


def parse_methods(methods: list[str] | str) -> list[str]:
    """`--method` values (comma lists, aliases, `-` for `_`) -> registered method names, in order, once each."""
    if isinstance(methods, str):
        methods = [methods]
    names: list[str] = []
    for item in methods:
        for name in str(item).split(","):
            name = name.strip().replace("-", "_")
            if not name:
                continue
            name = ALIASES.get(name, name)
            if name not in METHODS:
                raise SpecError(f"--method {name!r}: unknown; available: {', '.join(METHODS)}")
            if name not in names:
                names.append(name)
    if not names:
        raise SpecError("--method: give at least one method")
    return names
