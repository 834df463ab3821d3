"""Reading and replacing a model component's value in the forward pass: the one set of hooks that
intervene's edits (`interventions.EditSet`), their mean values (`interventions.means`) and the
sweep's patches and patch sources (`analysis/sweep/engine.py`) install.

Components, by the name the sweep and the mean values use:

  head   the output projection's input (every head; head h is columns h*head_dim .. (h+1)*head_dim)
  ffn    the MLP down-projection's input (every neuron)
  attn   the attention block's output
  mlp    the MLP block's output
  resid  the decoder layer's output (the residual stream after the layer)

Inputs are read and replaced by torch forward pre-hooks; outputs are read by torch forward hooks
and replaced by taps (`taps.py`) added first (`prepend=True`), so the probes' taps on the same
module record the edited output. A module returning a tuple has its first element read or replaced.
"""

from __future__ import annotations

from typing import Callable

import torch

from .taps import tap

INPUTS = ("head", "ffn")  # components that are a module's input; the others are a module's output


def first(output):
    """A module's output value: the first element of a tuple output."""
    return output[0] if isinstance(output, tuple) else output


def replace_first(output, value):
    """`output` with its value (`first`) replaced by `value`."""
    return (value, *output[1:]) if isinstance(output, tuple) else value


def row_mask(sel: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sel [B, q] -> a mask broadcastable to x: [B, q, 1], or [B*q, 1] for modules that see
    flattened tokens (OPT's fc1/fc2)."""
    return sel.reshape(-1, 1) if x.dim() == 2 else sel[..., None]


def component_module(adapter, kind: str, layer: int) -> torch.nn.Module:
    """The module whose input (head, ffn) or output (attn, mlp, resid) is the component."""
    return {
        "head": adapter.o_proj,
        "ffn": adapter.mlp_down,
        "attn": adapter.attn,
        "mlp": adapter.mlp,
        "resid": lambda i: adapter.layers[i],
    }[kind](layer)


def read_component(adapter, kind: str, layer: int, fn: Callable[[torch.Tensor], None]):
    """Call fn(value) with the component's value at every forward; returns the hook's handle."""
    module = component_module(adapter, kind, layer)
    if kind in INPUTS:

        def read_input(module, args):
            fn(args[0])

        return module.register_forward_pre_hook(read_input)

    def read_output(module, args, output):
        fn(first(output))

    return module.register_forward_hook(read_output)


def edit_component(adapter, kind: str, layer: int, fn: Callable[[torch.Tensor], torch.Tensor | None]):
    """Replace the component's value x by fn(x) at every forward (None: leave it); the edit runs before
    any other hook or tap on the module. Returns the hook's handle."""
    module = component_module(adapter, kind, layer)
    if kind in INPUTS:

        def edit_input(module, args):
            value = fn(args[0])
            return None if value is None else (value, *args[1:])

        return module.register_forward_pre_hook(edit_input, prepend=True)

    def edit_output(module, args, kwargs, output):
        value = fn(first(output))
        return None if value is None else replace_first(output, value)

    return tap(module, edit_output, prepend=True)


def edit_module(module: torch.nn.Module, where: str, fn: Callable[[torch.Tensor], torch.Tensor | None]):
    """Replace the module's input (`where="input"`: its first positional argument, or `hidden_states`
    when passed by keyword) or output value x by fn(x) at every forward (None: leave it), before any
    other hook or tap on the module, as `edit_component` does for a component. Returns the hook's
    handle. Feature edits use it at an SAE's site (`features.Site.locate` gives the module and where)."""
    if where == "input":

        def edit_input(module, args, kwargs):
            if args:
                value = fn(args[0])
                return None if value is None else ((value, *args[1:]), kwargs)
            value = fn(kwargs["hidden_states"])
            return None if value is None else (args, {**kwargs, "hidden_states": value})

        return module.register_forward_pre_hook(edit_input, prepend=True, with_kwargs=True)

    def edit_output(module, args, kwargs, output):
        value = fn(first(output))
        return None if value is None else replace_first(output, value)

    return tap(module, edit_output, prepend=True)
