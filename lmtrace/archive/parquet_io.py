"""Every Parquet file lmtrace writes carries a CRC32 per page, and every read of one checks them.

Writers go through `write_table` / `writer` (pyarrow's `write_page_checksum=True`); readers through
`read_table`, `parquet_file` and `read_dataset` (`page_checksum_verification=True`). A page whose
bytes do not match its checksum, or a file that does not decode, raises one `ArchiveDamaged` naming
the file relative to its run (docs/archive.md, "Checksums"). A file written without page checksums
(an archive of format 3 or older, a prompt file from elsewhere) reads as before: the check only
applies to pages that carry a checksum.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ..exits.errors import ArchiveDamaged
from . import layout

if TYPE_CHECKING:
    import pyarrow.dataset as ds

READ_ERRORS = (OSError, pa.ArrowException)


def write_table(table: pa.Table, where, **options) -> None:
    """`pq.write_table` with a checksum on every page."""
    pq.write_table(table, where, write_page_checksum=True, **options)


def writer(where, schema: pa.Schema, **options) -> pq.ParquetWriter:
    """`pq.ParquetWriter` with a checksum on every page."""
    return pq.ParquetWriter(where, schema, write_page_checksum=True, **options)


def read_table(path, columns: list[str] | None = None, filters=None) -> pa.Table:
    """The file's table (`columns` only; `filters` as pq.read_table takes them), pages checked."""
    try:
        return pq.read_table(path, columns=columns, filters=filters, page_checksum_verification=True)
    except READ_ERRORS as err:
        raise damage_of([Path(path)], err) from None


def parquet_file(path) -> pq.ParquetFile:
    """A ParquetFile whose reads check each page (the footer is read here: a damaged one raises)."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except READ_ERRORS as err:
        raise damage_of([Path(path)], err) from None


@cache
def _checked_format() -> ds.ParquetFileFormat:
    """The Parquet format whose scans check every page. pyarrow.dataset is imported here, on the first
    table read, not with this module: it costs ~0.3 s of CPU (it imports pandas), which a command that
    reads arrays only (`lmtrace features RUN --sae DIR` from the archive) need not pay."""
    import pyarrow.dataset as ds

    return ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
    )


def dataset(files) -> ds.Dataset:
    """A dataset over one or several Parquet files whose scans check each page they read."""
    import pyarrow.dataset as ds

    paths = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
    return ds.dataset(paths if len(paths) != 1 else paths[0], format=_checked_format())


def read_dataset(dataset: ds.Dataset, **to_table) -> pa.Table:
    """`dataset.to_table(**to_table)`, a damaged file named in one ArchiveDamaged."""
    try:
        return dataset.to_table(**to_table)
    except READ_ERRORS as err:
        raise damage_of([Path(f) for f in dataset.files], err) from None


def check_pages(files) -> None:
    """Read every page of `files` (a row group at a time) with its checksum checked, for a reader that
    cannot check them itself (DuckDB): ArchiveDamaged names the first damaged file."""
    for f in files:
        reader = parquet_file(f)
        try:
            for i in range(reader.num_row_groups):
                reader.read_row_group(i)
        except READ_ERRORS as err:
            raise damage_of([Path(f)], err) from None


def damage_of(files: list[Path], err: BaseException) -> BaseException:
    """The error to raise for a read of `files` that failed with `err`: ArchiveDamaged naming the
    first of them that does not read whole with its checksums checked, else `err` itself (a file that
    vanished while it was read, a column that is not there: not damage)."""
    if any(not f.exists() for f in files):
        return err  # a part merged away while it was read (archive/reader.read_table_files lists again)
    for f in files:
        try:
            pq.read_table(f, page_checksum_verification=True)
        except READ_ERRORS as own:
            return damaged_file(f, own)
    return err


def damaged_file(path: Path, err: BaseException | None = None) -> ArchiveDamaged:
    """ArchiveDamaged for `path`: named relative to the run directory holding it (the nearest
    directory above it with a manifest), else by its own name."""
    run_dir, rel = run_of(Path(path))
    if run_dir is None:
        reason = f" ({first_line(err, path.parent)})" if err is not None else ""
        return ArchiveDamaged(f"{path} is damaged{reason}", path=path.name)
    from .damage import Problem, damaged_message

    return ArchiveDamaged(damaged_message(run_id_of(run_dir), Problem(rel, "changed")), path=rel, run_dir=run_dir)


def run_of(path: Path) -> tuple[Path | None, str]:
    """(the run directory holding `path`, `path` relative to it), or (None, name)."""
    for parent in path.absolute().parents:
        if (parent / layout.MANIFEST).is_file():
            return parent, str(path.absolute().relative_to(parent))
    return None, path.name


def run_id_of(run_dir: Path) -> str:
    try:
        return str(json.loads((run_dir / layout.MANIFEST).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name


def first_line(err: BaseException | None, hide: Path | None = None) -> str:
    """The first line of an error's message, without the directory `hide` in it."""
    text = (str(err).splitlines() or [type(err).__name__])[0] if err is not None else ""
    if hide is not None:
        text = text.replace(str(hide.absolute()) + "/", "").replace(str(hide) + "/", "")
    return text or type(err).__name__
