"""Read prompts from the spec: an inline list or a .txt / .jsonl / .csv / .parquet file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .errors import SpecError
from .spec import PromptsSpec

_COLUMN_GUESSES = ("prompt", "text", "input")


def _pick_column(columns: list[str], wanted: str | None, path: Path) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise SpecError(f"{path}: no column {wanted!r} (columns: {', '.join(columns)}); set prompts.column")
        return wanted
    for name in _COLUMN_GUESSES:
        if name in columns:
            return name
    if len(columns) == 1:
        return columns[0]
    raise SpecError(f"{path}: cannot tell which column holds the prompts (columns: {', '.join(columns)}); set prompts.column")


def _read_file(path: Path, column: str | None) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [line for line in path.read_text().splitlines() if line.strip()]
    if suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecError(f"{path}:{n}: not valid JSON ({err.msg})") from None
            if isinstance(obj, str):
                rows.append(obj)
            elif isinstance(obj, dict):
                rows.append(str(obj[_pick_column(list(obj), column, path)]))
            else:
                raise SpecError(f"{path}:{n}: each line must be a JSON string or object")
        return rows
    if suffix == ".csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            col = _pick_column(list(reader.fieldnames or []), column, path)
            return [row[col] for row in reader]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        col = _pick_column(table.column_names, column, path)
        return [str(v) for v in table.column(col).to_pylist()]
    raise SpecError(f"{path}: unsupported prompt file type {suffix!r}; use .txt, .jsonl, .csv or .parquet")


def load_prompts(spec: PromptsSpec) -> list[str]:
    if spec.texts is not None:
        prompts = list(spec.texts)
    else:
        path = Path(spec.file)
        if not path.is_file():
            raise SpecError(f"prompts.file: {path} does not exist")
        try:
            prompts = _read_file(path, spec.column)
        except (OSError, UnicodeDecodeError) as err:
            raise SpecError(f"prompts.file: cannot read {path} ({err})") from None
    if not prompts:
        raise SpecError("prompts: the prompt list is empty; give at least one prompt")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise SpecError(f"prompts: prompt {empty[0]} is an empty string; every prompt needs text")
    return prompts
