"""Read prompts from the spec: an inline list or a .txt / .jsonl / .csv / .parquet file.

  .txt      one prompt per line; blank lines are skipped
  .jsonl    one JSON string, or one JSON object per line (the prompt column picked as below)
  .csv      a header row; the prompt column picked as below
  .parquet  the prompt column picked as below

The column is `prompts.column` when given, else the one named prompt / text / input (any case),
else the only column there is. The other columns are the prompts' metadata (prompt_metadata.py).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa

from ..exits.errors import SpecError
from . import prompt_metadata
from .run_spec import PromptsSpec

_COLUMN_GUESSES = ("prompt", "text", "input")


def _pick_column(columns: list[str], wanted: str | None, where: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise SpecError(
                f"{where}: no column {wanted!r} (columns: {', '.join(map(str, columns)) or 'none'}); fix prompts.column"
            )
        return wanted
    lower = {str(c).lower(): c for c in columns}
    for name in _COLUMN_GUESSES:
        if name in lower:
            return lower[name]
    if len(columns) == 1:
        return columns[0]
    if not columns:
        raise SpecError(f"{where}: no columns found; a prompt file needs a header / field naming the prompt column")
    raise SpecError(
        f"{where}: cannot tell which column holds the prompts (columns: {', '.join(map(str, columns))}); "
        f"set prompts.column"
    )


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if value is None:
        raise SpecError(f"{where}: the prompt is missing (null); every prompt needs text")
    raise SpecError(f"{where}: the prompt is a {type(value).__name__}, not text")


def _read_file(path: Path, column: str | None) -> tuple[list[str], pa.Table | None]:
    """The prompts of a file and its other columns (None: a file without any)."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()], None
    if suffix == ".jsonl":
        rows, objects, lines = [], [], []
        picked = None
        for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecError(f"{path}:{n}: not valid JSON ({err.msg}, column {err.colno})") from None
            if isinstance(obj, str):
                rows.append(obj)
                objects.append(None)
            elif isinstance(obj, dict):
                key = _pick_column(list(obj), column, f"{path}:{n}")
                picked = picked or key
                rows.append(_text(obj[key], f"{path}:{n}"))
                objects.append({k: v for k, v in obj.items() if k != key})
            else:
                raise SpecError(f"{path}:{n}: each line must be a JSON string or object, got {type(obj).__name__}")
            lines.append(n)
        return rows, prompt_metadata.from_json_rows(objects, lines, picked, str(path))
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None:
                return [], None
            col = _pick_column(list(reader.fieldnames), column, str(path))
            texts, rows = [], []
            for row in reader:
                # line numbers count the header as line 1
                texts.append(_text(row[col], f"{path}:{reader.line_num}"))
                rows.append(row)
            return texts, prompt_metadata.from_csv_rows(list(reader.fieldnames), rows, col, str(path))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:  # a page that carries a checksum is checked, as every Parquet read of lmtrace's
            table = pq.read_table(path, page_checksum_verification=True)
        except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid & co. for a damaged file
            raise SpecError(
                f"prompts.file: cannot read {path} as Parquet ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None
        col = _pick_column(table.column_names, column, str(path))
        texts = [_text(v, f"{path}: row {i}") for i, v in enumerate(table.column(col).to_pylist())]
        return texts, prompt_metadata.from_arrow(table, col, str(path))
    raise SpecError(
        f"{path}: unsupported prompt file type {suffix or '(no extension)'!r}; use .txt, .jsonl, .csv or .parquet"
    )


def load_prompts(spec: PromptsSpec) -> list[str]:
    return load_prompts_and_metadata(spec)[0]


def load_prompts_and_metadata(spec: PromptsSpec) -> tuple[list[str], pa.Table | None]:
    """The prompts, and the prompt file's other columns, one row per prompt (None: no such column)."""
    metadata = None
    if spec.texts is not None:
        prompts = list(spec.texts)
        source = "prompts.texts"
    else:
        path = Path(spec.file)
        if not path.exists():
            raise SpecError(
                f"prompts.file: {path} does not exist; check the path (relative paths in a spec "
                f"are relative to the spec's directory)"
            )
        if not path.is_file():
            raise SpecError(f"prompts.file: {path} is not a file")
        try:
            prompts, metadata = _read_file(path, spec.column)
        except UnicodeDecodeError as err:
            raise SpecError(f"prompts.file: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        except csv.Error as err:
            raise SpecError(f"prompts.file: {path} is not valid CSV ({err})") from None
        except OSError as err:
            raise SpecError(f"prompts.file: cannot read {path} ({err.strerror or err})") from None
        source = f"prompts.file {path}"
        if not prompts:
            raise SpecError(
                f"prompts.file: {path} contains no prompts (blank lines are skipped); add at least one prompt"
            )
    if not prompts:
        raise SpecError(f"{source}: the prompt list is empty; give at least one prompt")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise SpecError(f"{source}: prompt {empty[0]} is empty; every prompt needs text")
    return prompts, metadata


# --- chat spans -------------------------------------------------------------------------------
_SENTINEL = "\ue000lmtrace-span\ue001"  # private-use characters: no template rewrites them


def chat_messages(prompt: str, system: str | None) -> list[dict]:
    """The conversation `generate` renders for a chat prompt (see render_prompts)."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_spans(tokenizer, prompt: str, system: str | None, prompt_ids: list[int]) -> dict[str, tuple[int, int]]:
    """Token ranges [start, end) of the system message's and the user message's content in a chat prompt.

    The template is rendered again with one message's content replaced by a sentinel: the text before
    and after the sentinel is the template's own (role headers, end markers, any default preamble), so
    in the real rendering the content is exactly what lies between. A token belongs to a span when
    its characters overlap the content (a token straddling the boundary counts as content). The
    rendering must re-tokenise to the archived prompt ids, or there is no reliable mapping (error).
    """
    messages = chat_messages(prompt, system)
    render = lambda msgs: tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)  # noqa: E731
    rendered = render(messages)
    enc = tokenizer(
        rendered, add_special_tokens=False, return_offsets_mapping=bool(getattr(tokenizer, "is_fast", False))
    )
    if list(enc["input_ids"]) != list(prompt_ids):
        raise SpecError(
            "chat span: the chat template no longer renders the archived prompt tokens (tokenizer or "
            "template changed since the run); mask the positions explicitly with `mask`"
        )
    out = {}
    for i, message in enumerate(messages):
        with_sentinel = render([dict(m, content=_SENTINEL) if j == i else m for j, m in enumerate(messages)])
        if with_sentinel.count(_SENTINEL) != 1:
            raise SpecError(
                f"chat span: cannot locate the {message['role']} message in the rendered prompt "
                f"(the template repeats or drops it); mask the positions explicitly with `mask`"
            )
        before, after = with_sentinel.split(_SENTINEL)
        if not (rendered.startswith(before) and rendered.endswith(after) and len(before) + len(after) <= len(rendered)):
            raise SpecError(
                f"chat span: the template renders text around the {message['role']} message that depends "
                f"on its content; mask the positions explicitly with `mask`"
            )
        start, end = len(before), len(rendered) - len(after)
        if rendered[start:end].strip() != message["content"].strip():
            raise SpecError(
                f"chat span: the template rewrites the {message['role']} message's content; mask the "
                f"positions explicitly with `mask`"
            )
        if "offset_mapping" in enc:
            toks = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
            first, last = (toks[0], toks[-1] + 1) if toks else (0, 0)
        else:  # slow tokenizer: count the tokens of the text before and through the content
            first = len(tokenizer(rendered[:start], add_special_tokens=False)["input_ids"])
            last = len(tokenizer(rendered[:end], add_special_tokens=False)["input_ids"])
            if list(prompt_ids[:last]) != list(tokenizer(rendered[:end], add_special_tokens=False)["input_ids"]):
                raise SpecError(
                    f"chat span: the {message['role']} message's end is inside a token (slow tokenizer "
                    f"without offsets); mask the positions explicitly with `mask`"
                )
        out[message["role"]] = (first, last)
    return out


def render_prompts(tokenizer, prompts: list[str], chat: bool, system: str | None) -> tuple[list[str], list[list[int]]]:
    """Apply the chat template when asked, then tokenise each prompt on its own (no padding yet)."""
    rendered, ids = [], []
    for text in prompts:
        if chat:
            if getattr(tokenizer, "chat_template", None) is None:
                raise SpecError("prompts.chat: true but the model's tokenizer has no chat template; set chat: false")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            r = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            rendered.append(r)
            ids.append(tokenizer(r, add_special_tokens=False)["input_ids"])
        else:
            rendered.append(text)
            ids.append(tokenizer(text)["input_ids"])
        if not ids[-1]:
            raise SpecError(f"prompt {len(ids) - 1} tokenises to nothing; give it some text")
    return rendered, ids
