"""A report page read back: its embedded JSON, and its base64 arrays decoded with numpy (never
with lmtrace.report.blobs)."""

from __future__ import annotations

import base64
import json
import re

import numpy as np


def page_json(page: str, element_id: str):
    m = re.search(rf"<script type='application/json' id='{element_id}'>(.*?)</script>", page, re.S)
    assert m, element_id
    return json.loads(m.group(1).replace("<\\/", "</"))


def blob(blobs: dict, name: str) -> np.ndarray:
    item = blobs[name]
    if item["kind"] == "text":
        return np.asarray(item["values"], dtype=object).reshape(item["shape"])
    dtype = {"f2": "<f2", "f4": "<f4", "i4": "<i4"}[item["kind"]]
    return np.frombuffer(base64.b64decode(item["b64"]), dtype=dtype).reshape(item["shape"])
