"""`lmtrace serve`: check the bind, open the socket, print the address, serve until Ctrl-C."""

from __future__ import annotations

import errno
import signal
import socket
import sys
from pathlib import Path

from ..archive.runs import require_runs_root, runs_root
from ..exits.errors import SpecError
from ..serve.guard import check_bind

DEFAULT_PORT = 8765


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Bad address or busy port: one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise SpecError(f"--host {host}: not an address this machine can bind ({err.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise SpecError(f"port {port} on {host} is in use; pass another --port (0 picks a free one)") from None
        raise SpecError(f"cannot listen on {host}:{port} ({err.strerror}); pass another --host or --port") from None
    sock.listen(128)
    return sock


def serve(runs_dir: str | None, host: str, port: int, token: str | None, open_browser: bool) -> None:
    import uvicorn

    from ..serve import create_app

    check_bind(host, token)  # before anything listens
    root = require_runs_root(runs_root(runs_dir))  # a mistyped --runs-dir is an error, never an empty list
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    url = f"http://{shown_host}:{bound}/" + (f"?token={token}" if token else "")
    app = create_app(Path(root), token=token, host=host)
    print(f"lmtrace serve: runs in {root.resolve()} at {url}  (read-only; Ctrl-C stops)", file=sys.stderr, flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", access_log=False, server_header=False, date_header=False, lifespan="off"
        )
    )
    # Ctrl-C or SIGTERM is how a server is meant to end (exit 0), not an interruption (exit 3, as the
    # CLI's handler would make it): uvicorn shuts down gracefully, then re-raises the signal it caught.
    stop = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for sig, handler in stop.items():
            signal.signal(sig, handler)


class _Stopped(Exception):
    """A stop signal after uvicorn's graceful shutdown."""


def _stopped(signum, frame) -> None:
    raise _Stopped
