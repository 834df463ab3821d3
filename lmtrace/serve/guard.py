"""What keeps `lmtrace serve` a local, read-only viewer: the bind rule, the access token, the
Host header check and the security headers every response carries.

- Binding an address other than loopback needs a token (`check_bind`): anyone who can reach the
  port could otherwise read every run.
- With a token, every request must carry it: an `Authorization: Bearer T` header, or the cookie
  that a first visit with `?token=T` sets (HttpOnly, SameSite=Strict), so links keep working
  without the token in every address.
- On loopback the Host header must name the loopback address: a web page cannot then reach the
  server through a domain it re-points at 127.0.0.1 (DNS rebinding).
- Only GET and HEAD are answered; there is no CORS header, so other origins cannot read answers.
"""

from __future__ import annotations

import ipaddress
import secrets
import re
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlencode

from ..errors import SpecError

COOKIE = "lmtrace_token"

# No inline script or style and nothing from another origin: token texts and prompts are inserted
# as text by app.js, and this policy keeps any markup that slipped through from running.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
TOKEN_FORM = re.compile(r"[A-Za-z0-9._~-]{8,}")


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip("[]") in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve runs on a non-loopback address without an access token."""
    if token is not None and not TOKEN_FORM.fullmatch(token):
        raise SpecError("--token must be at least 8 characters of A-Z a-z 0-9 . _ ~ - (it travels in an address "
                        "and a cookie); e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`")
    if not is_loopback(host) and token is None:
        raise SpecError(f"--host {host} is not a loopback address: anyone who can reach it could read every run; "
                        f"pass --token T as well (e.g. `--token $(python -c 'import secrets; print(secrets.token_urlsafe())')`), "
                        f"or bind 127.0.0.1")


def _host_name(host_header: str) -> str:
    """`127.0.0.1:8765` -> `127.0.0.1`; `[::1]:8765` -> `[::1]`."""
    if host_header.startswith("["):
        return host_header.split("]")[0] + "]"
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class Guard:
    """ASGI middleware: method, Host and token checks before the app; security headers after it."""

    def __init__(self, app, *, token: str | None, loopback: bool):
        self.app = app
        self.token = token
        self.loopback = loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan events: nothing to guard
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["method"] not in ("GET", "HEAD"):
            return await _plain(send, 405, "lmtrace serve is read-only: only GET and HEAD are answered",
                                [(b"allow", b"GET, HEAD")])
        if self.loopback and _host_name(headers.get("host", "")).lower() not in LOOPBACK_NAMES:
            return await _plain(send, 403, "this server answers only requests addressed to localhost / 127.0.0.1")
        if self.token is not None:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            given = query.get("token")
            if given is not None:  # a first visit with ?token=T: set the cookie and drop it from the address
                if not secrets.compare_digest(given.encode(), self.token.encode()):
                    return await _plain(send, 401, "wrong token: open the address `lmtrace serve` printed")
                rest = urlencode([(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"))
                                  if k != "token"])
                location = scope["path"] + (f"?{rest}" if rest else "")
                cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                return await _plain(send, 303, "token accepted", [(b"location", location.encode("latin-1")),
                                                                  (b"set-cookie", cookie.encode("latin-1"))])
            if not self._authorised(headers):
                return await _plain(send, 401, "this server needs its access token: open the address "
                                               "`lmtrace serve` printed (it ends in ?token=...)")

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


async def _plain(send, status: int, text: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                            *extra, *SECURITY_HEADERS]})
    await send({"type": "http.response.body", "body": body})
