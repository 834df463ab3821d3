"""The SAEs of feature edits (ablate_feature, clamp_feature, steer_feature): each entry's `sae` resolved
to a directory (a SAELens directory, or the short name of an SAE the parent run recorded in its
manifest `features`, then its recorded path), read and checked the way `capture.features` reads and
checks them (`capture/feature_probe.py`), and written back into the entry as data: the directory and
the sha256 of its weights."""

from __future__ import annotations

from pathlib import Path

from ...digest import file_sha256
from ...exits.errors import SpecError
from ...features import parse_hook_name, read_sae
from ...features.edits import check_features
from ...features.format import WEIGHTS
from ...features.refs import resolve_sae_ref
from ...features.sites import check_sae_sites
from ..feature_probe import LoadedSae
from .entries import EntryBase, FeatureEntry


def load_edit_saes(entries: list[EntryBase], recorded: list[dict]) -> tuple[list[EntryBase], dict[int, LoadedSae]]:
    """(entries with each feature edit's `sae` resolved and its `sae_sha256` set, {entry index: its SAE}).

    One line (SpecError) for an unknown SAE, an unreadable one, an unsupported hook point, a feature the
    SAE does not have, or weights whose checksum differs from the one an entry records."""
    out, saes = list(entries), {}
    by_path: dict[Path, LoadedSae] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, FeatureEntry):
            continue
        where = f"interventions[{i}] ({e.kind})"
        path = resolve_sae_ref(e.sae, recorded, where, "the parent run").path
        if path not in by_path:
            sae = read_sae(path)
            site = parse_hook_name(sae.cfg.hook_name, f"{where}: SAE {path}")
            by_path[path] = LoadedSae(path.name, path, sae, site, 0, False, file_sha256(path / WEIGHTS))
        loaded = by_path[path]
        if e.sae_sha256 is not None and e.sae_sha256 != loaded.sha256:
            raise SpecError(
                f"{where}: the weights of SAE {path} differ from those recorded (sha256 {e.sae_sha256[:12]}…); "
                f"restore that SAE or make a new child"
            )
        check_features(loaded.sae, [e.feature_edit()], f"{path} ({where})")
        out[i] = e.model_copy(update={"sae": str(path), "sae_sha256": loaded.sha256})
        saes[i] = loaded
    return out, saes


def check_edit_sites(saes: dict[int, LoadedSae], adapter) -> None:
    """Refuse an SAE whose hook point the model lacks or whose d_in does not match the model (a transcoder:
    its output hook point and d_out too), one line."""
    for i, s in sorted(saes.items()):
        check_sae_sites(adapter, s.sae.cfg, f"interventions[{i}]: SAE {s.path}")
