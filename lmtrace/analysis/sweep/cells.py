"""The cells of a sweep: one per component (and position, where positions are swept).

`heads` -> (layer, head), `attn` / `mlp` / `layers` -> layer, `neurons:L` -> neuron of layer L,
`positions` -> a token position hidden from every query, `resid:A-B` -> (layer, position) of the
residual stream after the layer (patching only). Validated against the model's shape; sorted by
layer, so a batch of consecutive cells starts as high in the model as it can (the engine skips
the layers below a batch's lowest edited layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...exits.errors import SpecError

OVER_SIMPLE = {"heads": "head", "attn": "attn", "mlp": "mlp", "layers": "layer", "positions": "position"}
# the columns that name a cell in the sweep's tables (null where a coordinate does not apply); `q_head`
# is the Cell's `head` (archive/columns.py: why not `head`)
CELL_KEYS = ("component", "layer", "q_head", "neuron", "position")


@dataclass(frozen=True)
class Cell:
    component: str  # head | attn | mlp | layer | neuron | resid | position
    layer: int | None = None
    head: int | None = None
    neuron: int | None = None
    position: int | None = None  # None: every position

    def start_layer(self) -> int:
        return 0 if self.layer is None else self.layer


def _range_list(text: str, what: str) -> list[int]:
    # imported here: capture.interventions imports torch, and the views read CELL_KEYS / OVER_SIMPLE
    # from this module without a model
    from ...capture.interventions import parse_range_list

    return parse_range_list(text, what)


def _positions(text: str | None, what: str) -> list[int] | None:
    if text is None or text == "all":
        return None
    return sorted(set(_range_list(text, what)))


def build_cells(
    over: str,
    edit: str,
    positions_text: str | None,
    n_layers: int,
    n_heads: int,
    d_ffn: int,
    prompt_len: int,
    edited: range | None = None,
) -> list[Cell]:
    """The swept cells of `--over` / `--edit` / `--positions`, validated against the model; sorted by layer.

    `edited`: the positions an edit can reach when it starts at a later step (`from_step`); `resid`
    goes over them by default instead of the prompt positions."""
    over = over.strip()
    positions = _positions(positions_text, "positions")
    if positions is not None:
        bad = [p for p in positions if p < 0]
        if bad:
            raise SpecError(f"positions: {bad} are negative")
    if over in OVER_SIMPLE:
        cells = _simple_cells(OVER_SIMPLE[over], edit, positions, n_layers, n_heads, prompt_len)
    elif over.startswith("neurons:"):
        cells = _neuron_cells(over, edit, positions, n_layers, d_ffn)
    elif over.startswith("resid:"):
        cells = _resid_cells(over, edit, positions, n_layers, edited if edited is not None else range(prompt_len))
    else:
        raise SpecError(f"--over {over!r}: expected heads, attn, mlp, layers, neurons:LAYER, positions or resid:A-B")
    if not cells:
        raise SpecError(f"--over {over}: the sweep is empty (no positions?)")
    return sorted(
        cells, key=lambda c: (c.start_layer(), c.head or 0, c.neuron or 0, -1 if c.position is None else c.position)
    )


def _layer_ok(over: str, layer: int, n_layers: int) -> int:
    if not 0 <= layer < n_layers:
        raise SpecError(f"--over {over}: layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
    return layer


def _simple_cells(comp: str, edit: str, positions, n_layers: int, n_heads: int, prompt_len: int) -> list[Cell]:
    """The cells of `--over heads | attn | mlp | layers | positions` (component `comp`), each at every position or,
    with `positions`, once per listed position; positions default to the prompt's."""
    if comp == "position":
        if edit != "zero":
            raise SpecError(
                "--over positions hides one position at a time from every query (intervene's "
                "mask_positions); it takes --edit zero. To patch positions use --over resid:A-B"
            )
        return [Cell("position", position=p) for p in (positions if positions is not None else range(prompt_len))]
    if comp == "layer" and edit == "patch":
        raise SpecError(
            "--over layers --edit patch would replace the whole residual stream; patch it at "
            "single positions with --over resid:A-B"
        )
    base = (
        [Cell("head", layer, h) for layer in range(n_layers) for h in range(n_heads)]
        if comp == "head"
        else [Cell(comp, layer) for layer in range(n_layers)]
    )
    if positions is None:
        return base
    return [Cell(c.component, c.layer, c.head, c.neuron, p) for c in base for p in positions]


def _neuron_cells(over: str, edit: str, positions, n_layers: int, d_ffn: int) -> list[Cell]:
    """The cells of `--over neurons:LAYER`: every MLP neuron of the layer (per position with `positions`)."""
    try:
        layer = int(over.split(":", 1)[1])
    except ValueError:
        raise SpecError(f"--over {over!r}: expected neurons:LAYER, e.g. neurons:7") from None
    _layer_ok(over, layer, n_layers)
    if not d_ffn:
        raise SpecError(f"--over {over}: this model has no single MLP down-projection (d_ffn unknown)")
    if edit == "patch":
        raise SpecError("--over neurons: takes --edit zero or mean")
    base = [Cell("neuron", layer, neuron=n) for n in range(d_ffn)]
    if positions is None:
        return base
    return [Cell("neuron", layer, neuron=c.neuron, position=p) for c in base for p in positions]


def _resid_cells(over: str, edit: str, positions, n_layers: int, default) -> list[Cell]:
    """The cells of `--over resid:A-B`: the residual stream after each listed layer at each position (`positions`,
    else `default`)."""
    if edit != "patch":
        raise SpecError(
            "--over resid:A-B patches the residual stream at one position at a time; it takes "
            "--edit patch --source RUN_B"
        )
    layers = _range_list(over.split(":", 1)[1], f"--over {over}")
    if not layers:
        raise SpecError(f"--over {over!r}: expected resid:A-B, e.g. resid:0-29")
    for layer in layers:
        _layer_ok(over, layer, n_layers)
    return [
        Cell("resid", layer, position=p)
        for layer in sorted(set(layers))
        for p in (positions if positions is not None else default)
    ]
