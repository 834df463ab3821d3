"""A model's position limit and the check that a run fits in it (prompt + new tokens), shared by
`validate` (before loading, from the config file) and generation (after tokenising)."""

from __future__ import annotations

from ..exits.errors import SpecError

# Config keys that give a model's position limit, in order (GPT-2: n_positions, some: n_ctx).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def model_positions(config) -> int | None:
    """The number of positions the model was built for, from its (text) config; None when it does not say.

    Taken as the config declares it: with rope scaling, transformers' configs carry the scaled
    length in max_position_embeddings; sliding windows limit attention, not positions.
    """
    if not isinstance(config, dict):
        config = config.get_text_config().to_dict() if hasattr(config, "get_text_config") else config.to_dict()
    config = config.get("text_config") or config
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(
    prompt_lens: list[int], max_new_tokens: int, positions: int | None, model_ref: str, estimated: bool = False
) -> None:
    """Refuse (exit 2) a run whose longest prompt + max_new_tokens exceeds the model's positions."""
    if positions is None or not prompt_lens:
        return
    longest = max(prompt_lens)
    if longest + max_new_tokens > positions:
        room = positions - longest
        what = "at least " if estimated else ""
        raise SpecError(
            f"generation.max_new_tokens: {max_new_tokens} new tokens after a prompt of {what}{longest} "
            f"token(s) exceed the {positions} positions of model {model_ref}; "
            + (f"use max_new_tokens <= {room}" if room > 0 else "shorten the prompt")
        )
