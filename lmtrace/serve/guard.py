"""What keeps `lmtrace serve` a local, read-only viewer: the bind rule, the access token, the
Host header check and the security headers every response carries.

- Binding an address other than loopback needs a token (`check_bind`): anyone who can reach the
  port could otherwise read every run.
- With a token, every request must carry it: an `Authorization: Bearer T` header, or the cookie
  that a first visit with `?token=T` sets (HttpOnly, SameSite=Strict), so links keep working
  without the token in every address.
- On loopback the Host header must name a loopback address (an address in 127.0.0.0/8, `[::1]`,
  `localhost`) or the very name the server was bound to (`--host ip6-localhost`): a web page cannot
  then reach the server through a domain it re-points at 127.0.0.1 (DNS rebinding), since the
  browser sends that domain as the Host.
- Only GET and HEAD are answered; there is no CORS header, so other origins cannot read answers.
- Every refusal is one line of JSON (errors.py), as the routes' errors are.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import socket
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, quote, urlencode

from ..exits.errors import SpecError
from .errors import FORBIDDEN, NOT_ALLOWED, UNAUTHORISED, error_body, error_headers

COOKIE = "lmtrace_token"

# No inline script or style and nothing from another origin: token texts and prompts are inserted
# as text by app.js, and this policy keeps any markup that slipped through from running.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]
LOOPBACK_NAMES = ("localhost",)
TOKEN_FORM = re.compile(r"[A-Za-z0-9._~-]{8,}")


def _loopback_address(name: str) -> bool:
    """True for an address literal in 127.0.0.0/8 or ::1 (`[::1]` too)."""
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _addresses(host: str) -> list[str] | None:
    """The addresses a --host name resolves to (None: it resolves to none)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    return [info[4][0] for info in infos] or None


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1), `localhost`, and a name every address of which
    is a loopback one (`ip6-localhost`, `localhost6` where /etc/hosts has them)."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES or _loopback_address(name):
        return True
    addresses = _addresses(name)
    return addresses is not None and all(_loopback_address(a) for a in addresses)


def check_bind(host: str, token: str | None) -> None:
    """Refuse a --host that names no address of this machine, and to serve runs on a non-loopback
    address without an access token."""
    if _addresses(host) is None:
        raise SpecError(
            f"--host {host}: not an address this machine can bind (it resolves to none); "
            f"pass an address such as 127.0.0.1"
        )
    if token is not None and not TOKEN_FORM.fullmatch(token):
        raise SpecError(
            "--token must be at least 8 characters of A-Z a-z 0-9 . _ ~ - (it travels in an address "
            "and a cookie); e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )
    if not is_loopback(host) and token is None:
        raise SpecError(
            f"--host {host} is not a loopback address: anyone who can reach it could read every run; "
            f"pass --token T as well (e.g. `--token $(python -c 'import secrets; print(secrets.token_urlsafe())')`), "
            f"or bind 127.0.0.1"
        )


def _host_name(host_header: str) -> str:
    """`127.0.0.1:8765` -> `127.0.0.1`; `[::1]:8765` -> `[::1]`."""
    if host_header.startswith("["):
        return host_header.split("]")[0] + "]"
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def host_allowed(host_header: str, bound: str) -> bool:
    """Whether a loopback server answers a request with this Host header: a loopback address literal
    (127.0.0.0/8, [::1]), `localhost`, or the name the server was bound to. Never another name, even
    one that resolves to loopback now: that is what a DNS-rebinding page sends."""
    name = _host_name(host_header).lower().strip("[]")
    return name in LOOPBACK_NAMES or name == bound.strip("[]").lower() or _loopback_address(name)


def redirect_target(path: str, rest: str) -> str:
    """Where a first visit with ?token=T goes: the same path on this server, the token left out.
    Leading slashes and backslashes collapse to one (`//evil.example.com` would leave the server),
    and the path is percent-encoded (a Location header is ASCII)."""
    local = "/" + path.lstrip("/\\")
    return quote(local, safe="/:@!$&'()*+,;=-._~") + (f"?{rest}" if rest else "")


class Guard:
    """ASGI middleware: method, Host and token checks before the app; security headers after it.
    `host`: the address the server is bound to; a loopback one turns the Host check on."""

    def __init__(self, app, *, token: str | None, host: str = "127.0.0.1"):
        self.app = app
        self.token = token
        self.host = host
        self.loopback = is_loopback(host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan events: nothing to guard
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["method"] not in ("GET", "HEAD"):
            return await _refuse(
                send,
                NOT_ALLOWED,
                "lmtrace serve is read-only: only GET and HEAD are answered",
                [(b"allow", b"GET, HEAD")],
            )
        if self.loopback and not host_allowed(headers.get("host", ""), self.host):
            return await _refuse(
                send,
                FORBIDDEN,
                "this server answers only requests addressed to a loopback address "
                "(localhost, 127.0.0.1, [::1]) or the --host it was started with",
            )
        if self.token is not None:
            pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"))
            given = dict(pairs).get("token")
            if given is not None:  # a first visit with ?token=T: set the cookie and drop it from the address
                if not secrets.compare_digest(given.encode("utf-8", "replace"), self.token.encode()):
                    return await _refuse(send, UNAUTHORISED, "wrong token: open the address `lmtrace serve` printed")
                location = redirect_target(scope["path"], urlencode([(k, v) for k, v in pairs if k != "token"]))
                cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                body = json.dumps({"location": location}).encode()
                return await _send(
                    send,
                    303,
                    body,
                    [(b"location", location.encode("ascii")), (b"set-cookie", cookie.encode("latin-1"))],
                )
            if not self._authorised(headers):
                return await _refuse(
                    send,
                    UNAUTHORISED,
                    "this server needs its access token: open the address "
                    "`lmtrace serve` printed (it ends in ?token=...)",
                )

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _authorised(self, headers: dict) -> bool:
        expected = self.token.encode()
        auth = headers.get("authorization", "")
        if auth.startswith("Bearer ") and secrets.compare_digest(auth[7:].encode(), expected):
            return True
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except CookieError:  # a malformed cookie header is an unauthenticated request
            return False
        value = cookie.get(COOKIE)
        return value is not None and secrets.compare_digest(value.value.encode(), expected)


async def _refuse(send, status: int, text: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    """A refusal of the guard itself: `{"error": text}`."""
    await _send(send, status, error_body(text), extra)


async def _send(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [*error_headers(body), *extra, *SECURITY_HEADERS]}
    )
    await send({"type": "http.response.body", "body": body})
