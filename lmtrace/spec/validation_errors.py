"""A pydantic validation error of a run spec as one line: the dotted path of the first problem,
what is wrong with it, the value given, how many other problems there are."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .sections import RunSpec, section_class

# Messages for values that match none of a union's alternatives (pydantic would list each alternative).
_UNION_HINTS = {
    "capture.layers": "expected `all`, a list of layer indices like [0, 5, -1], or {stride: N, start: M}",
    "capture.residual.vectors_at": "expected `all` or a list of layer indices like [0, 15, -1]",
    "generation.eos_token_id": "expected a token id or a list of token ids",
}
_SECTION_HINTS = {
    "model": "expected a model reference (embedded:NAME, a path or a hub id) or a section with ref:",
    "prompts": "expected a list of prompts, or a section with texts: [...] or file: PATH",
}


def _field_names(cls: type[BaseModel], seen: set | None = None) -> set[str]:
    seen = set() if seen is None else seen
    if cls in seen:
        return set()
    seen.add(cls)
    names = set(cls.model_fields)
    for f in cls.model_fields.values():
        sub = section_class(f.annotation)
        if sub is not None:
            names |= _field_names(sub, seen)
    return names


def _is_tag(part: Any, names: set[str]) -> bool:
    """pydantic puts the union alternative (`list[int]`, `LayerStride`, `function-after[..]`) into `loc`."""
    return isinstance(part, str) and part not in names


def _clean(loc: tuple, names: set[str], keep_last: bool = False) -> tuple:
    last = len(loc) - 1
    return tuple(p for i, p in enumerate(loc) if not _is_tag(p, names) or (keep_last and i == last))


def _valid_keys(path: tuple) -> list[str]:
    cls: type[BaseModel] | None = RunSpec
    for part in path:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            return []
        cls = section_class(cls.model_fields[part].annotation)
    return list(cls.model_fields) if cls is not None else []


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line for the first problem: the dotted path, what is wrong, what was given."""
    names = _field_names(RunSpec)
    errors = err.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    group = [first]
    union_root = None
    tag_at = next(
        (
            i
            for i, p in enumerate(loc)
            if _is_tag(p, names) and not (first["type"] == "extra_forbidden" and i == len(loc) - 1)
        ),
        None,
    )
    if tag_at is not None:
        # A value matched none of a union's alternatives: report the alternative it got furthest into.
        union_root = loc[:tag_at]
        group = [
            e
            for e in errors
            if tuple(e["loc"][:tag_at]) == union_root and len(e["loc"]) > tag_at and _is_tag(e["loc"][tag_at], names)
        ] or [first]
        first = max(group, key=lambda e: (len(e["loc"]), e["type"] == "extra_forbidden"))
        if len(first["loc"]) > tag_at + 1:
            union_root = None
    kind = first["type"]
    path = _clean(tuple(first["loc"]), names, keep_last=kind == "extra_forbidden")
    dotted = ".".join(str(p) for p in path)
    got = first.get("input")
    msg = first["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if union_root is not None:
        dotted = ".".join(str(p) for p in _clean(union_root, names))
        msg = _UNION_HINTS.get(dotted) or "expected one of: " + "; ".join(dict.fromkeys(e["msg"] for e in group))
    elif kind == "extra_forbidden":
        key = str(path[-1])
        valid = _valid_keys(path[:-1])
        close = difflib.get_close_matches(key, valid, n=1)
        msg = "unknown key" + (f"; did you mean {close[0]!r}?" if close else "")
        if valid:
            msg += f" (valid keys {'under ' + '.'.join(map(str, path[:-1])) if len(path) > 1 else 'at the top level'}: {', '.join(valid)})"
    elif kind == "missing":
        msg = "required key is missing" + (f": {_SECTION_HINTS[dotted]}" if dotted in _SECTION_HINTS else "")
    elif kind in ("model_type", "dict_type"):
        msg = _SECTION_HINTS.get(dotted, "expected a section (a mapping of key: value)")
    shown = ""
    if kind not in ("extra_forbidden", "missing") and not isinstance(got, (dict, list)) and "(got " not in msg:
        shown = f" (got {_shown(got)})"
    others = {
        _clean(tuple(e["loc"]), names, keep_last=e["type"] == "extra_forbidden") for e in errors if e not in group
    }
    others.discard(path)
    more = f" [+{len(others)} more problem{'s' if len(others) > 1 else ''}]" if others else ""
    # a model-level check already names its keys ("prompts.system needs prompts.chat: true")
    where = f"{dotted}: " if dotted and not msg.startswith(dotted + ".") else ""
    return f"{source}: {where}{msg}{shown}{more}"
