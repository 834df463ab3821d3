"""`lmtrace serve`: a local, read-only web explorer over a runs directory (docs/serve.md).

`create_app` (app.py) builds the ASGI application; guard.py holds its security rules, catalog.py
which runs it may show, queries.py what each page reads from a run, static/ the frontend."""

from .app import create_app

__all__ = ["create_app"]
