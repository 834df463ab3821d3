"""Rebuild the spec of an existing run for `lmtrace generate --resume RUN_ID`."""

from __future__ import annotations

import json

import yaml

from ..archive import layout
from ..archive.runs import find_run, read_manifest, runs_root
from ..exits.errors import SpecError
from ..spec.run_spec import apply_override, build_spec


def spec_for_resume(ref: str, runs_dir: str | None, overrides: list[str]):
    """The run's resolved spec (exactly what it was started with) and the spec text as given."""
    path = find_run(ref, runs_root(runs_dir))
    manifest = read_manifest(path)
    if overrides:
        raise SpecError(
            "--set and --memory-budget cannot change a run being resumed; it continues with the spec it was started with"
        )
    data = json.loads(json.dumps(manifest["spec_resolved"]))
    # the run lives where it was found, under the id it has
    data = apply_override(data, f"output.run_id={json.dumps(path.name)}")
    data = apply_override(data, f"output.runs_dir={json.dumps(str(path.parent))}")
    spec = build_spec(data, f"{path / layout.MANIFEST} (spec_resolved)")
    text = (path / layout.SPEC).read_text() if (path / layout.SPEC).is_file() else yaml.safe_dump(data)
    return spec, text


def run_kind(ref: str, runs_dir: str | None) -> str:
    """generate (a spec's own run) or intervene (a child, resumed by replaying its edits)."""
    return read_manifest(find_run(ref, runs_root(runs_dir))).get("kind", "generate")
