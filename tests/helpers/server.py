"""`lmtrace serve`'s app in a real uvicorn server, in a thread, on a free loopback port."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path


class LiveServer:
    """uvicorn serving `create_app(...)` from a thread, on a free loopback port."""

    def __init__(self, runs: Path, token: str | None = None):
        import uvicorn

        from lmtrace.commands.serve import bind_socket
        from lmtrace.serve import create_app

        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(runs, token=token), log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def request(self, path: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
        """One request with `path` sent exactly as given (no client-side normalisation of `..`)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def json(self, path: str):
        status, headers, body = self.request(path)
        assert status == 200, (path, status, body)
        assert headers["content-type"] == "application/json"
        return json.loads(body)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
