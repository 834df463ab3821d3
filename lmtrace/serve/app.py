"""The Starlette application of `lmtrace serve`: a page, its script and style, and JSON routes.

Routes (all GET; `{run}` is a run directory's name as the runs directory lists it; `{seq}`, `{step}`,
`{layer}`, `{head}` are whole numbers, anything else is not there: 404):
  /                                            the page (runs list, run, sequence views; hash-routed)
  /static/{app,tokenview,compare}.{js,css}, /static/groups.js   the frontend: tokenview.* from viewdata, the rest
                                               from this package
  /api/runs?kind=&status=&model=&q=            runs list
  /api/runs/{run}                              a run's header
  /api/runs/{run}/sequences?page=&q=&sort=     a page of its sequences
  /api/runs/{run}/groups?by=COLUMN             its sequences grouped by a column (stats --by, heads --by)
  /api/runs/{run}/sequences/{seq}              one sequence's tokens
  /api/runs/{run}/sequences/{seq}/steps/{step} the selected token: attention grid, alternatives, lens, DLA
  /api/runs/{run}/sequences/{seq}/steps/{step}/over_heads   its attention averaged and maximised over heads
  /api/runs/{run}/sequences/{seq}/steps/{step}/attention/{layer}/{head}   one head's row over keys
  /api/runs/{run}/sequences/{seq}/attention/{layer}/{head}   one head's pattern over every step
  /api/runs/{run}/sequences/{seq}/pattern/{layer}/{head}     one head's query x key pattern, packed (patterns.py)
  /api/runs/{run}/sequences/{seq}/pattern/{layer}            every head of a layer, packed (small multiples)
  /api/runs/{run}/sequences/{seq}/steps/{step}/over_heads/packed   the mean / max over heads, packed
  /api/runs/{run}/sequences/{seq}/lens                       the logit lens, layers x steps (top-1, probability)
  /api/runs/{run}/sequences/{seq}/head_dla/{layer}/{head}    one head's DLA over the steps
  /api/runs/{run}/sequences/{seq}/parent       an intervention child's sequence next to its parent's
  /api/runs/{run}/sequences/{seq}/parent/internals   its per-layer and per-head divergence from its parent
  /api/runs/{run}/features/{sae}/{feature}?top=&window=&positions=   a feature's page (viewdata/features.py)
  /api/runs/{run}/sweeps/{sweep}               a sweep's effect heatmaps (effects.zarr)
  /api/runs/{run}/sweeps/{sweep}/cell?metric=&layer=&head=&neuron=&position=&feature=   one cell's rows
  /api/compare?a=RUN&b=RUN                     compare_runs of two runs (archives only)
  /api/compare/pair?a=RUN&b=RUN&pair=K         one pair's per-layer and per-head figures over its steps
Every handler is a plain function, run by Starlette in its thread pool: the reads block, not the loop.
Every error is one JSON line with its status (errors.py), an address no route matches included.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..exits.errors import ArchiveDamaged, ArchiveError, LmtraceError, RunNotFoundError
from ..viewdata import features, patterns, queries, token_extras
from ..viewdata.groups import sequence_groups_view
from ..viewdata.page_code import token_view_css, token_view_js
from .catalog import Catalog
from .child_view import against_parent, edits
from .compare_view import child_figures, comparison, pair_figures
from .errors import (
    BAD_PARAMETER,
    CONFLICT,
    INTERNAL,
    NOT_FOUND,
    BadParameter,
    NotFound,
    Scrubber,
    error_response,
    int_parameter,
    whole_number,
)
from .guard import Guard
from .sweep_view import cell_rows, sweep_heatmaps, sweep_list

# The only files served, by name: nothing under /static is looked up on disk from the address
STATIC = {
    "app.js": "application/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "groups.js": "application/javascript; charset=utf-8",
    "compare.js": "application/javascript; charset=utf-8",
    "compare.css": "text/css; charset=utf-8",
    "tokenview.js": "application/javascript; charset=utf-8",
    "tokenview.css": "text/css; charset=utf-8",
}
# the token view is the report's too: its code comes from viewdata (page_code.py)
SHARED = {"tokenview.js": token_view_js, "tokenview.css": token_view_css}


def _static(name: str) -> bytes:
    if name in SHARED:
        return SHARED[name]().encode("utf-8")
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _int_param(request: Request, name: str, default: int = 0) -> int:
    return int_parameter(request.query_params.get(name), name, default)


# The path parts that name a number, and what they are called in an answer that says one is not there
NUMBERS = {"seq": "sequence", "step": "step", "layer": "layer", "head": "head", "feature": "feature"}


def _numbers(request: Request) -> dict:
    """The route's path parameters, those in NUMBERS as ints (NotFound for anything that is not a number)."""
    return {k: whole_number(v, NUMBERS[k]) if k in NUMBERS else v for k, v in request.path_params.items()}


class _Api:
    """The JSON routes' handlers over one runs directory: each returns its answer (a dict) or raises
    lmtrace's errors, which `create_app`'s `answer` maps to one-line JSON errors."""

    def __init__(self, catalog: Catalog, scrub: Scrubber):
        self.catalog, self.scrub = catalog, scrub

    def routes(self, answer) -> list[Route]:
        return [
            Route("/api/runs", answer(self.runs)),
            Route("/api/runs/{run}", answer(self.run)),
            Route("/api/runs/{run}/sequences", answer(self.sequences)),
            Route("/api/runs/{run}/groups", answer(self.groups)),
            Route("/api/runs/{run}/sequences/{seq}", answer(self.sequence)),
            Route("/api/runs/{run}/sequences/{seq}/steps/{step}", answer(self.step)),
            Route("/api/runs/{run}/sequences/{seq}/steps/{step}/over_heads", answer(self.over_heads)),
            Route("/api/runs/{run}/sequences/{seq}/steps/{step}/attention/{layer}/{head}", answer(self.head)),
            Route("/api/runs/{run}/sequences/{seq}/attention/{layer}/{head}", answer(self.pattern)),
            Route("/api/runs/{run}/sequences/{seq}/pattern/{layer}/{head}", answer(self.head_image)),
            Route("/api/runs/{run}/sequences/{seq}/pattern/{layer}", answer(self.layer_images)),
            Route("/api/runs/{run}/sequences/{seq}/steps/{step}/over_heads/packed", answer(self.over_heads_packed)),
            Route("/api/runs/{run}/sequences/{seq}/lens", answer(self.lens)),
            Route("/api/runs/{run}/sequences/{seq}/head_dla/{layer}/{head}", answer(self.head_dla)),
            Route("/api/runs/{run}/sequences/{seq}/parent", answer(self.parent)),
            Route("/api/runs/{run}/sequences/{seq}/parent/internals", answer(self.parent_internals)),
            Route("/api/runs/{run}/features/{sae}/{feature}", answer(self.feature)),
            Route("/api/runs/{run}/sweeps/{sweep}", answer(self.sweep)),
            Route("/api/runs/{run}/sweeps/{sweep}/cell", answer(self.cell)),
            Route("/api/compare", answer(self.compare)),
            Route("/api/compare/pair", answer(self.compare_pair)),
        ]

    def runs(self, request: Request):
        q = request.query_params
        rows = self.catalog.rows(
            kind=q.get("kind") or None,
            status=q.get("status") or None,
            model=q.get("model") or None,
            query=q.get("q") or None,
        )
        for r in rows:
            if r.get("error"):
                r["error"] = self.scrub(r["error"])
        return {"runs_dir": self.catalog.root.resolve().name or "runs", "runs": rows}

    def run(self, request: Request):
        rid = request.path_params["run"]
        try:
            r = self.catalog.open(rid)
            return {**queries.run_info(r), "sweeps": sweep_list(r), "edits": edits(r)}
        except ArchiveError as err:  # damaged: the page shows the one line instead of the run
            if isinstance(err, ArchiveDamaged):
                self.catalog.note_damage(err)
            return {"run_id": rid, "damaged": self.scrub(str(err))}

    def sequences(self, request: Request):
        r = self.catalog.open(request.path_params["run"])
        return queries.sequence_page(
            r,
            page=_int_param(request, "page"),
            query=request.query_params.get("q", ""),
            sort=request.query_params.get("sort", "index"),
        )

    def groups(self, request: Request):
        return sequence_groups_view(self.catalog.open(request.path_params["run"]), request.query_params.get("by"))

    def sequence(self, request: Request):
        p = _numbers(request)
        return queries.sequence_tokens(self.catalog.open(p["run"]), p["seq"])

    def step(self, request: Request):
        p = _numbers(request)
        return token_extras.selected_token(self.catalog.open(p["run"]), p["seq"], p["step"])

    def over_heads(self, request: Request):
        p = _numbers(request)
        return token_extras.step_over_heads(self.catalog.open(p["run"]), p["seq"], p["step"])

    def pattern(self, request: Request):
        p = _numbers(request)
        return token_extras.head_pattern(self.catalog.open(p["run"]), p["seq"], p["layer"], p["head"])

    def head_image(self, request: Request):
        p = _numbers(request)
        return patterns.head_image(self.catalog.open(p["run"]), p["seq"], p["layer"], p["head"])

    def layer_images(self, request: Request):
        p = _numbers(request)
        return patterns.layer_images(self.catalog.open(p["run"]), p["seq"], p["layer"])

    def over_heads_packed(self, request: Request):
        p = _numbers(request)
        return patterns.over_heads_image(self.catalog.open(p["run"]), p["seq"], p["step"])

    def lens(self, request: Request):
        p = _numbers(request)
        return patterns.lens_grid(self.catalog.open(p["run"]), p["seq"])

    def head_dla(self, request: Request):
        p = _numbers(request)
        return patterns.head_dla_over_steps(self.catalog.open(p["run"]), p["seq"], p["layer"], p["head"])

    def head(self, request: Request):
        p = _numbers(request)
        return queries.head_row(self.catalog.open(p["run"]), p["seq"], p["step"], p["layer"], p["head"])

    def _parent_of(self, child):
        parent_id = (child.manifest.get("parent") or {}).get("run_id")
        try:
            return self.catalog.open(parent_id) if parent_id else None
        except RunNotFoundError:  # the parent lives in another runs directory: the child's side alone
            return None

    def parent(self, request: Request):
        p = _numbers(request)
        child = self.catalog.open(p["run"])
        return against_parent(child, self._parent_of(child), p["seq"])

    def parent_internals(self, request: Request):
        p = _numbers(request)
        child = self.catalog.open(p["run"])
        if edits(child) is None:
            raise NotFound(f"run {child.id} is not an intervention child (kind {child.manifest.get('kind')!r})")
        queries.check_sequence(child, p["seq"])
        parent = self._parent_of(child)
        if parent is None:
            raise NotFound(f"the parent of run {child.id} is not in the runs directory")
        return child_figures(parent, child, p["seq"])

    def feature(self, request: Request):
        p = _numbers(request)
        return features.feature_page(
            self.catalog.open(p["run"]),
            p["sae"],
            p["feature"],
            top=_int_param(request, "top", features.PAGE_TOP),
            window=_int_param(request, "window", features.PAGE_WINDOW),
            positions=request.query_params.get("positions", "generated"),
        )

    def sweep(self, request: Request):
        p = _numbers(request)
        return sweep_heatmaps(self.catalog.open(p["run"]), p["sweep"])

    def cell(self, request: Request):
        p, q = _numbers(request), request.query_params
        coords = {
            k: _int_param(request, k) for k in ("layer", "head", "neuron", "position", "feature") if q.get(k, "") != ""
        }
        return cell_rows(self.catalog.open(p["run"]), p["sweep"], q.get("metric", ""), coords)

    def compare(self, request: Request):
        q = request.query_params
        if not q.get("a") or not q.get("b"):
            raise NotFound("compare needs two runs: /api/compare?a=RUN&b=RUN")
        return comparison(self.catalog.open(q["a"]), self.catalog.open(q["b"]))

    def compare_pair(self, request: Request):
        q = request.query_params
        if not q.get("a") or not q.get("b"):
            raise NotFound("a pair of a comparison needs two runs: /api/compare/pair?a=RUN&b=RUN&pair=K")
        return pair_figures(self.catalog.open(q["a"]), self.catalog.open(q["b"]), _int_param(request, "pair"))


def create_app(runs_dir: Path, *, token: str | None = None, host: str = "127.0.0.1") -> Guard:
    """The ASGI application over `runs_dir`, wrapped in its Guard (token, Host, methods, headers): the page,
    its static files, and the JSON routes of `_Api`."""
    catalog = Catalog(Path(runs_dir))
    page = _static("index.html")
    scrub = Scrubber(catalog.root)

    def _error(status: int, message: str) -> JSONResponse:
        return error_response(status, message, scrub)

    def answer(fn):
        """A route handler: calls `fn(request)` and maps lmtrace's errors to one-line JSON errors."""

        def handler(request: Request):
            try:
                return JSONResponse(fn(request))
            except (RunNotFoundError, NotFound) as err:
                return _error(NOT_FOUND, str(err))
            except ArchiveDamaged as err:  # bytes that fail their checksum: named relative to the run
                catalog.note_damage(err)
                return JSONResponse(
                    {"error": " ".join(scrub(str(err)).split()), "file": err.path}, status_code=CONFLICT
                )
            except ArchiveError as err:  # a damaged or unfinished archive: the run's own one-line message
                return _error(CONFLICT, str(err))
            except (BadParameter, LmtraceError) as err:  # a bad query parameter
                return _error(BAD_PARAMETER, str(err))

        return handler

    def index(request: Request):
        return Response(page, media_type="text/html; charset=utf-8")

    def static(request: Request):
        name = request.path_params["name"]
        if name not in STATIC:
            return _error(NOT_FOUND, f"no static file {name!r}")
        return Response(_static(name), media_type=STATIC[name])

    def not_found(request: Request, exc: HTTPException):
        """No route matches: JSON like every other answer (a 404, or the status Starlette chose)."""
        return _error(
            exc.status_code,
            "no such address: the routes are listed in docs/serve.md" if exc.status_code == NOT_FOUND else exc.detail,
        )

    def internal(request: Request, exc: Exception):
        """A fault of the server itself: one JSON line naming the kind, never a path or a traceback."""
        return _error(INTERNAL, f"internal error ({type(exc).__name__}); the server's terminal has the details")

    routes = [Route("/", index), Route("/static/{name}", static), *_Api(catalog, scrub).routes(answer)]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found, Exception: internal})
    return Guard(app, token=token, host=host)
