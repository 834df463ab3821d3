"""What a report embeds: which sequences, steps, layers and heads (documented in docs/report.md).

A page must stay usable however large the run: by default it shows the first `DEFAULT_SEQUENCES`
sequences, at most `MAX_STEPS` steps of each (a regular stride past that), the per-head
step × key heatmaps of three layers (first, middle, last captured), and the token view and the
layer × head grid starting at one step (the last one shown, or --attention-step clamped to each
sequence's steps). Everything left out is said on the page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..exits.errors import SpecError
from ..spec.steps import parse_sequences, parse_steps

DEFAULT_SEQUENCES = 2
MAX_STEPS = 256
# rows of a steps x keys attention heatmap: one per step up to this, else a stride over the steps
# shown (each row is a whole context of float16 weights per head: the bulk of a long run's page)
MAX_HEATMAP_ROWS = 128


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def thin(steps: list[int], limit: int) -> list[int]:
    """At most `limit` of `steps`, a regular stride that keeps the first."""
    stride = max(1, -(-len(steps) // limit))
    return steps[::stride]


@dataclass
class Selection:
    sequences: list[int]
    steps: dict[int, list[int]]  # sequence -> steps shown (sorted)
    available: dict[int, int]  # sequence -> committed (readable) steps
    layers: list[int]  # model layers with per-head step × key heatmaps
    heatmap_steps: dict[int, list[int]]  # sequence -> rows of the step × key heatmaps (≤ MAX_HEATMAP_ROWS)
    attention_step: dict[int, int]  # sequence -> the step first selected in the token view and of the layer × head grid
    notes: list[str] = field(default_factory=list)


def default_steps(available: int, max_steps: int = MAX_STEPS) -> list[int]:
    stride = max(1, -(-available // max_steps))
    return list(range(0, available, stride))


def default_layers(captured: list[int]) -> list[int]:
    if not captured:
        return []
    picks = [captured[0], captured[len(captured) // 2], captured[-1]]
    return sorted(set(picks))


def select(
    *,
    n_sequences: int,
    committed: dict[int, int],
    captured_layers: list[int],
    sequences: list[int | str] | None = None,
    steps: str | None = None,
    layers: list[int] | None = None,
    attention_step: int | None = None,
) -> Selection:
    notes = []
    if sequences:
        chosen = parse_sequences(sequences, n_sequences)
    else:
        chosen = list(range(min(DEFAULT_SEQUENCES, n_sequences)))
        if n_sequences > len(chosen):
            notes.append(
                f"showing sequences {', '.join(map(str, chosen))} of {n_sequences}; "
                f"choose others with --sequence K (repeatable)"
            )
    available = {s: int(committed.get(s, 0)) for s in chosen}
    shown: dict[int, list[int]] = {}
    for s in chosen:
        if steps is not None:
            shown[s] = parse_steps(steps, available[s], stride=True, noun="readable step(s)")
        else:
            shown[s] = default_steps(available[s])
            if len(shown[s]) < available[s]:
                stride = shown[s][1] - shown[s][0]
                notes.append(
                    f"sequence {s}: showing every {ordinal(stride)} of its {available[s]} steps "
                    f"({len(shown[s])} steps); choose others with --steps, e.g. --steps 0-63"
                )
    if layers:
        bad = [layer for layer in layers if layer not in captured_layers]
        if bad:
            raise SpecError(f"--layer {bad[0]} was not captured (captured layers: {captured_layers})")
        chosen_layers = sorted(set(layers))
    else:
        chosen_layers = default_layers(captured_layers)
    if attention_step is not None and attention_step < 0:
        raise SpecError(f"--attention-step {attention_step}: a step counts from 0; give 0 or more")
    att: dict[int, int] = {}
    for s in chosen:
        if not shown[s]:
            continue
        if attention_step is None:
            att[s] = shown[s][-1]
        elif attention_step >= available[s]:  # a shorter sequence starts at its last step
            att[s] = available[s] - 1
            notes.append(
                f"sequence {s} has steps 0..{available[s] - 1}: its token view and attention grid start "
                f"at its last step, not --attention-step {attention_step}"
            )
        else:
            att[s] = attention_step
    rows = {s: thin(shown[s], MAX_HEATMAP_ROWS) for s in chosen}
    for s in chosen:
        if len(rows[s]) < len(shown[s]):
            notes.append(
                f"sequence {s}: the attention step × key heatmaps have one row for every "
                f"{ordinal(-(-len(shown[s]) // MAX_HEATMAP_ROWS))} step shown "
                f"({len(rows[s])} rows); narrow --steps for every step"
            )
    return Selection(chosen, shown, available, chosen_layers, rows, att, notes)
