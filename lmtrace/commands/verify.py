"""`lmtrace verify RUN`: a complete run's files against the checksums recorded at completion."""

from __future__ import annotations

import sys

from ..archive.runs import find_run, read_manifest, runs_root
from ..output.jsonout import json_line


def verify_run(ref: str, runs_dir: str | None, json_out: bool, quiet: bool = False) -> int:
    """`lmtrace verify RUN`: every committed file against the checksums recorded at completion.
    Returns the exit code: 0 intact, 2 damaged (or nothing to verify: the run is not complete).
    `quiet`: nothing on stdout; a damaged run still gets its one error line on stderr."""
    from ..archive.integrity import verify

    path = find_run(ref, runs_root(runs_dir))
    m = read_manifest(path)
    run_id = m.get("run_id", path.name)
    if m.get("status") != "complete":
        result = {
            "run_id": run_id,
            "status": m.get("status"),
            "ok": None,
            "message": f"run {run_id} is {m.get('status')}: checksums are recorded when a run completes",
        }
        code = 0
    else:
        problems, n, recorded = verify(path, m)
        result = {
            "run_id": run_id,
            "status": "damaged" if problems else "complete",
            "ok": not problems,
            "files_checked": n,
            "checksums_recorded": recorded,
            "problems": [{"path": p.path, "kind": p.kind} for p in problems],
        }
        if problems:
            shown = "; ".join(str(p) for p in problems[:5]) + (
                f"; ... {len(problems) - 5} more" if len(problems) > 5 else ""
            )
            result["message"] = f"run {run_id} is damaged: {shown}"
        elif recorded:
            result["message"] = f"run {run_id}: {n} files match their checksums"
        else:
            result["message"] = (
                f"run {run_id}: no checksums recorded (completed before lmtrace recorded them); its tables are present"
            )
        code = 2 if problems else 0
    if json_out:
        print(json_line(result))
    elif code:
        print(f"error: {result['message']}", file=sys.stderr)
    elif not quiet:
        print(result["message"])
    return code
