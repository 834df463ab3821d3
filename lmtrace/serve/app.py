"""The Starlette application of `lmtrace serve`: a page, its script and style, and JSON routes.

Routes (all GET; `{run}` is a run id as the runs directory lists it):
  /                                            the page (runs list, run, sequence views; hash-routed)
  /static/{app,tokenview}.{js,css}            the frontend, from this package (no other file is served)
  /api/runs?kind=&status=&model=&q=            runs list
  /api/runs/{run}                              a run's header
  /api/runs/{run}/sequences?page=&q=&sort=     a page of its sequences
  /api/runs/{run}/sequences/{seq}              one sequence's tokens
  /api/runs/{run}/sequences/{seq}/steps/{step} the selected token: attention grid, alternatives, lens, DLA
  /api/runs/{run}/sequences/{seq}/steps/{step}/over_heads   its attention averaged and maximised over heads
  /api/runs/{run}/sequences/{seq}/steps/{step}/attention/{layer}/{head}   one head's row over keys
  /api/runs/{run}/sequences/{seq}/attention/{layer}/{head}   one head's pattern over every step
  /api/runs/{run}/sequences/{seq}/parent       an intervention child's sequence next to its parent's
  /api/runs/{run}/sweeps/{sweep}               a sweep's effect heatmaps (effects.zarr)
  /api/runs/{run}/sweeps/{sweep}/cell?metric=&layer=&head=&neuron=&position=   one cell's rows
  /api/compare?a=RUN&b=RUN                     compare_runs of two runs (archives only)
Every handler is a plain function, run by Starlette in its thread pool: the reads block, not the loop.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ArchiveDamaged, ArchiveError, LmtraceError, RunNotFoundError
from . import queries, token_extras
from .child_view import against_parent, edits
from .compare_view import comparison
from .sweep_view import cell_rows, sweep_heatmaps, sweep_list
from .catalog import Catalog
from .guard import Guard, is_loopback

# The only files served, by name: nothing under /static is looked up on disk from the address
STATIC = {"app.js": "application/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8",
          "tokenview.js": "application/javascript; charset=utf-8", "tokenview.css": "text/css; charset=utf-8"}


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _int_param(request: Request, name: str, default: int = 0) -> int:
    value = request.query_params.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise queries.NotFound(f"{name}={value!r} is not a whole number") from None


def create_app(runs_dir: Path, *, token: str | None = None, host: str = "127.0.0.1") -> Guard:
    """The ASGI application over `runs_dir`, wrapped in its Guard (token, Host, methods, headers)."""
    catalog = Catalog(Path(runs_dir))
    page = _static("index.html")

    def answer(fn):
        """A route handler: calls `fn(request)` and maps lmtrace's errors to one-line JSON errors."""
        def handler(request: Request):
            try:
                return JSONResponse(fn(request))
            except RunNotFoundError as err:
                return _error(404, str(err))
            except queries.NotFound as err:
                return _error(404, str(err))
            except ArchiveDamaged as err:  # bytes that fail their checksum: named relative to the run
                catalog.note_damage(err)
                return JSONResponse({"error": str(err), "file": err.path}, status_code=409)
            except ArchiveError as err:  # a damaged or unfinished archive: the run's own one-line message
                return _error(409, str(err))
            except LmtraceError as err:  # a bad query parameter
                return _error(400, str(err))
        return handler

    def index(request: Request):
        return Response(page, media_type="text/html; charset=utf-8")

    def static(request: Request):
        name = request.path_params["name"]
        if name not in STATIC:
            return _error(404, f"no static file {name!r}")
        return Response(_static(name), media_type=STATIC[name])

    def runs(request: Request):
        q = request.query_params
        return {"runs_dir": catalog.root.name or str(catalog.root),
                "runs": catalog.rows(kind=q.get("kind") or None, status=q.get("status") or None,
                                     model=q.get("model") or None, query=q.get("q") or None)}

    def run(request: Request):
        rid = request.path_params["run"]
        try:
            r = catalog.open(rid)
            return {**queries.run_info(r), "sweeps": sweep_list(r), "edits": edits(r)}
        except ArchiveError as err:  # damaged: the page shows the one line instead of the run
            if isinstance(err, ArchiveDamaged):
                catalog.note_damage(err)
            return {"run_id": rid, "damaged": str(err)}

    def sequences(request: Request):
        r = catalog.open(request.path_params["run"])
        return queries.sequence_page(r, page=_int_param(request, "page"), query=request.query_params.get("q", ""),
                                     sort=request.query_params.get("sort", "index"))

    def sequence(request: Request):
        p = request.path_params
        return queries.sequence_tokens(catalog.open(p["run"]), p["seq"])

    def step(request: Request):
        p = request.path_params
        return token_extras.selected_token(catalog.open(p["run"]), p["seq"], p["step"])

    def over_heads(request: Request):
        p = request.path_params
        return token_extras.step_over_heads(catalog.open(p["run"]), p["seq"], p["step"])

    def pattern(request: Request):
        p = request.path_params
        return token_extras.head_pattern(catalog.open(p["run"]), p["seq"], p["layer"], p["head"])

    def parent(request: Request):
        p = request.path_params
        child = catalog.open(p["run"])
        parent_id = (child.manifest.get("parent") or {}).get("run_id")
        try:
            parent_run = catalog.open(parent_id) if parent_id else None
        except RunNotFoundError:  # the parent lives in another runs directory: the child's side alone
            parent_run = None
        return against_parent(child, parent_run, p["seq"])

    def sweep(request: Request):
        p = request.path_params
        return sweep_heatmaps(catalog.open(p["run"]), p["sweep"])

    def cell(request: Request):
        p, q = request.path_params, request.query_params
        coords = {k: _int_param(request, k) for k in ("layer", "head", "neuron", "position") if q.get(k, "") != ""}
        return cell_rows(catalog.open(p["run"]), p["sweep"], q.get("metric", ""), coords)

    def compare(request: Request):
        q = request.query_params
        if not q.get("a") or not q.get("b"):
            raise queries.NotFound("compare needs two runs: /api/compare?a=RUN&b=RUN")
        return comparison(catalog.open(q["a"]), catalog.open(q["b"]))

    def head(request: Request):
        p = request.path_params
        return queries.head_row(catalog.open(p["run"]), p["seq"], p["step"], p["layer"], p["head"])

    routes = [
        Route("/", index),
        Route("/static/{name}", static),
        Route("/api/runs", answer(runs)),
        Route("/api/runs/{run}", answer(run)),
        Route("/api/runs/{run}/sequences", answer(sequences)),
        Route("/api/runs/{run}/sequences/{seq:int}", answer(sequence)),
        Route("/api/runs/{run}/sequences/{seq:int}/steps/{step:int}", answer(step)),
        Route("/api/runs/{run}/sequences/{seq:int}/steps/{step:int}/over_heads", answer(over_heads)),
        Route("/api/runs/{run}/sequences/{seq:int}/steps/{step:int}/attention/{layer:int}/{head:int}", answer(head)),
        Route("/api/runs/{run}/sequences/{seq:int}/attention/{layer:int}/{head:int}", answer(pattern)),
        Route("/api/runs/{run}/sequences/{seq:int}/parent", answer(parent)),
        Route("/api/runs/{run}/sweeps/{sweep}", answer(sweep)),
        Route("/api/runs/{run}/sweeps/{sweep}/cell", answer(cell)),
        Route("/api/compare", answer(compare)),
    ]
    return Guard(Starlette(routes=routes), token=token, loopback=is_loopback(host))
