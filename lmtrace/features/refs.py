"""What a command's SAE argument names: `--sae DIR|NAME` (explain, sweep), an edit's `SAE:F` (intervene).

A NAME is the short name a run recorded for an SAE in its manifest `features` (`generate --sae`,
`lmtrace features`); it stands for the directory recorded there, whose weights must still be the ones
recorded. Anything else must be a SAELens directory. Either way the SAE is named as the run names these
weights where it recorded them, else after its directory (`short_names`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..digest import file_sha256
from ..exits.errors import SpecError
from .format import WEIGHTS


@dataclass(frozen=True)
class SaeRef:
    name: str  # the run's short name for these weights, else the directory's
    path: Path  # the SAE's directory, resolved
    sha256: str  # of its weights file
    recorded: dict | None  # the run's manifest `features` entry for these weights, if it has one


def transcoder_record(cfg) -> dict:
    """A transcoder's output side as the archive records it beside its input side (`hook_name_out`,
    `site_out`, `layer_out`, `d_out`); {} for an SAE, whose record stays as it was."""
    if not getattr(cfg, "hook_name_out", None):
        return {}
    from .sites import parse_hook_name

    out = parse_hook_name(cfg.hook_name_out)
    return {"hook_name_out": cfg.hook_name_out, "site_out": out.kind, "layer_out": out.layer, "d_out": cfg.d_out}


def sae_record(name: str, path: Path, sha256: str, sae, site) -> dict:
    """What the archive records of an SAE wherever a run uses one (manifest `features`, an explain
    result's `sae`, a sweep's `features`): its name, directory, weights' sha256, hook, site and sizes (a
    transcoder's output side too, `transcoder_record`)."""
    cfg = sae.cfg
    return {
        "name": name,
        "path": str(path),
        "sha256": sha256,
        "hook_name": cfg.hook_name,
        "site": site.kind,
        "layer": site.layer,
        "d_in": cfg.d_in,
        "d_sae": cfg.d_sae,
        "architecture": cfg.architecture,
        **transcoder_record(cfg),
    }


def short_names(paths: list[Path]) -> list[str]:
    """Each SAE directory's name, reduced to letters, digits, `_` and `-`, made unique with _2, _3..."""
    out: list[str] = []
    for path in paths:
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", path.resolve().name).strip("_") or "sae"
        name, n = base, 2
        while name in out:
            name, n = f"{base}_{n}", n + 1
        out.append(name)
    return out


def resolve_sae_ref(ref: str, recorded: list[dict], where: str, owner: str) -> SaeRef:
    """`ref` -> its SAE directory (the module docstring's rules); one line (SpecError, prefixed by `where`)
    for a name whose recorded directory is gone or whose weights changed, or a path that is not an SAE
    directory. `owner` names the run whose manifest `recorded` is ("run X", "the parent run"). The weights are
    hashed, not read: callers read the SAE when they need it."""
    entry = next((f for f in recorded if f.get("name") == ref), None)
    if entry is not None:
        path = Path(entry["path"])
        if not (path / WEIGHTS).is_file():
            raise SpecError(
                f"{where}: {owner} recorded SAE {ref!r} at {path}, which is no longer there; "
                f"give the SAE's directory instead"
            )
        sha = file_sha256(path / WEIGHTS)
        if sha != entry.get("sha256"):
            raise SpecError(
                f"{where}: the weights at {path} are not the ones {owner} recorded as {ref!r} "
                f"(sha256 differs); give the SAE's directory"
            )
        return SaeRef(ref, path.resolve(), sha, entry)
    path = Path(ref).expanduser()
    if not path.is_dir():
        names = ", ".join(sorted(f["name"] for f in recorded if f.get("name"))) or "none"
        raise SpecError(
            f"{where}: unknown SAE {ref!r}: not an SAE directory, nor the name of an SAE {owner} recorded "
            f"(its SAEs: {names}); give a SAELens directory (cfg.json + {WEIGHTS})"
        )
    sha = file_sha256(path / WEIGHTS) if (path / WEIGHTS).is_file() else ""
    same = next((f for f in recorded if sha and f.get("sha256") == sha), None)
    name = same["name"] if same is not None else short_names([path])[0]
    return SaeRef(name, path.resolve(), sha, same)
