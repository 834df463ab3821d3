"""`lmtrace serve`: a local, read-only web explorer over a runs directory (docs/serve.md).

`create_app` (app.py) builds the ASGI application; guard.py holds its security rules, catalog.py
which runs it may show; what each page reads from a run comes from lmtrace.viewdata; static/ holds
the frontend (the token view's script and style, shared with the report, are viewdata's)."""

from .app import create_app

__all__ = ["create_app"]
