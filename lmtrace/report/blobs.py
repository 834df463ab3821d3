"""Numbers embedded in a report page: typed arrays as base64, in one JSON block.

Every figure refers to its data by name (`{"$blob": name}`); the page's script decodes the blobs
once and hands plain arrays to Plotly, and `static.py` resolves the same references with numpy.
Values are stored at the archive's own precision (attention rows as float16 when the run stored
float16), so what the page shows is exactly what the archive holds: `decode` is the reference
reader that tests use to compare a page's numbers with the archive.
"""

from __future__ import annotations

import base64
import json

import numpy as np

# JSON-safe dtype codes: little-endian, as the page's DataView reads them
_CODES = {
    "float16": "f2",
    "float32": "f4",
    "float64": "f4",
    "int32": "i4",
    "int64": "i4",
    "int16": "i4",
    "int8": "i4",
    "uint8": "i4",
    "bool": "i4",
}


class Blobs:
    """Named arrays to embed; `ref(name)` is what a figure puts where Plotly expects the values."""

    def __init__(self):
        self.items: dict[str, dict] = {}

    def add(self, name: str, values, dtype: str | None = None) -> dict:
        """Store `values` (array-like of numbers; NaN = missing) under `name`; returns its reference."""
        arr = np.asarray(values)
        if arr.dtype.kind in "OU":  # texts
            self.items[name] = {"kind": "text", "shape": list(arr.shape), "values": [str(v) for v in arr.ravel()]}
            return ref(name)
        code = _CODES[dtype or arr.dtype.name]
        raw = np.ascontiguousarray(arr.astype("<" + code))
        self.items[name] = {
            "kind": code,
            "shape": list(arr.shape),
            "b64": base64.b64encode(raw.tobytes()).decode("ascii"),
        }
        return ref(name)

    def add_texts(self, name: str, texts) -> dict:
        return self.add(name, np.asarray(list(texts), dtype=object))

    def to_json(self) -> str:
        # "</" must not appear inside the page's <script> element
        return json.dumps(self.items, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")

    def nbytes(self) -> int:
        return sum(len(b.get("b64", "")) + sum(len(v) for v in b.get("values", [])) for b in self.items.values())


def ref(name: str) -> dict:
    return {"$blob": name}


def decode(item: dict) -> np.ndarray:
    """One embedded blob back to numpy (texts as an object array)."""
    if item["kind"] == "text":
        return np.asarray(item["values"], dtype=object).reshape(item["shape"])
    raw = base64.b64decode(item["b64"])
    return np.frombuffer(raw, dtype="<" + item["kind"]).reshape(item["shape"])


def resolve(obj, items: dict):
    """A figure with every `{"$blob": name}` replaced by its numpy array (for the static export)."""
    if isinstance(obj, dict):
        if set(obj) == {"$blob"}:
            return decode(items[obj["$blob"]])
        return {k: resolve(v, items) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, items) for v in obj]
    return obj
