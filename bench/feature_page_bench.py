"""`lmtrace serve`'s feature page (`#/run/RUN/feature/SAE/F`) over a 10,000-sequence run: its data
request, `viewdata.features.feature_page` in this process and `/api/runs/RUN/features/SAE/F` through
serve's app in a real uvicorn server (tests/helpers/server.LiveServer) on a loopback port.

The run is bench/feature_find_bench.py's (`build`: a small real run widened to --sequences sequences
with one random SAE's feature arrays, d_sae 16,384, top 32). Timed, wall and CPU seconds of this
process (the server runs in a thread of it): the viewdata function on a freshly opened run (its
first answer of a latent: the arrays read), then again on the same run object; over HTTP, the first
request of a latent on a server just started, the same latent asked again with other `top` /
`window` (best of --repeats), and a second latent's first request. `--code DIR` times the lmtrace of
another checkout (e.g. a worktree of an older commit) on the same run.

    .venv/bin/python bench/feature_page_bench.py [--sequences 10000] [--repeats 3] [--keep DIR] [--code DIR]
Writes bench/results/feature_page.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "feature_page.json"


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, fn())."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def get(port: int, path: str) -> dict:
    """One request (LiveServer.json's, with a longer timeout: the old page took minutes on a loaded machine)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise SystemExit(f"GET {path}: {r.status} {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def second_latent(run_dir: Path, name: str, first: int) -> int:
    """Another often active latent (the most active in the run's last 256 sequences, not `first`)."""
    import numpy as np
    import zarr

    ids = np.asarray(zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")[f"feat_{name}_idx"][-256:])
    counts = np.bincount(ids[ids >= 0].ravel())
    counts[first] = -1
    return int(np.argmax(counts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="a small complete run to copy (default: generate one)")
    ap.add_argument("--sequences", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="build the wide run in this directory and keep it (reused if there)")
    ap.add_argument("--code", type=Path, default=REPO, help="the lmtrace checkout to time (default: this one)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sys.path.insert(0, str(BENCH))
    from feature_find_bench import NAME, build

    tmp = Path(tempfile.mkdtemp(prefix="lmtrace-feature-page-bench-"))
    try:
        runs = args.keep or (tmp / "wide")
        run_id, _, feature = build(runs, args.sequences, args.source, tmp)
        other = second_latent(runs / run_id, NAME, feature)
        sys.path.insert(0, str(args.code.resolve()))
        for mod in [m for m in sys.modules if m == "lmtrace" or m.startswith("lmtrace.")]:
            del sys.modules[mod]  # build() imported this checkout's: time --code's
        from lmtrace.archive.reader import Run
        from lmtrace.viewdata.features import feature_page
        from tests.helpers.server import LiveServer

        result: dict = {"sequences": args.sequences, "feature": feature, "other_feature": other, "code": str(args.code)}
        run = Run(runs / run_id)
        wall, cpu, page = timed(lambda: feature_page(run, NAME, feature))
        result.update(viewdata_first_s=round(wall, 3), viewdata_first_cpu_s=round(cpu, 3))
        again = [timed(lambda: feature_page(run, NAME, feature, top=10, window=4))[:2] for _ in range(args.repeats)]
        result.update(
            viewdata_again_s=round(min(w for w, _ in again), 3), viewdata_again_cpu_s=round(min(c for _, c in again), 3)
        )
        result.update(active_tokens=page["active_tokens"], tokens=page["tokens"], examples=len(page["examples"]))
        server = LiveServer(runs)
        try:
            api = f"/api/runs/{run_id}/features/{NAME}"
            wall, cpu, _ = timed(lambda: get(server.port, f"{api}/{feature}"))
            result.update(http_first_s=round(wall, 3), http_first_cpu_s=round(cpu, 3))
            again = [
                timed(lambda: get(server.port, f"{api}/{feature}?top=10&window=4"))[:2] for _ in range(args.repeats)
            ]
            result.update(
                http_again_s=round(min(w for w, _ in again), 3), http_again_cpu_s=round(min(c for _, c in again), 3)
            )
            wall, cpu, _ = timed(lambda: get(server.port, f"{api}/{other}"))
            result.update(http_other_first_s=round(wall, 3), http_other_first_cpu_s=round(cpu, 3))
        finally:
            server.stop()
        result.update(load_avg=os.getloadavg(), cpus=os.cpu_count())
        args.out.parent.mkdir(exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
