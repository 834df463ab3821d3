"""Every error `lmtrace serve` answers: JSON `{"error": "one line"}` with the status docs/serve.md
lists, from the guard (401, 403, 405), the routes (400, 404, 409) and anything unexpected (500),
with no server path in it.

- 400: a bad query parameter (`page=abc`, `sort=x`);
- 401: the access token is missing or wrong; 403: a Host header the server does not answer;
- 404: a run, sequence, step, layer, head, sweep or address that is not there;
- 405: a method other than GET or HEAD;
- 409: the run's archive is damaged or unfinished where the answer needs it.
"""

from __future__ import annotations

import json
from pathlib import Path

from starlette.responses import JSONResponse

from ..viewdata.errors import BadParameter, NotFound  # noqa: F401 (raised by the routes, answered here)

BAD_PARAMETER, UNAUTHORISED, FORBIDDEN, NOT_FOUND, NOT_ALLOWED, CONFLICT, INTERNAL = 400, 401, 403, 404, 405, 409, 500


class Scrubber:
    """Takes the server's own paths out of a message: the runs directory (as given, absolute and
    resolved) becomes its name, so an answer never tells where the runs live on disk."""

    def __init__(self, root: Path):
        root = Path(root)
        name = root.resolve().name or "runs"
        seen = {str(p) for p in (root, root.absolute(), root.resolve()) if str(p) not in ("", ".", "/")}
        self.pairs = sorted(((p, name) for p in seen), key=lambda x: -len(x[0]))

    def __call__(self, text: str) -> str:
        for path, name in self.pairs:
            text = text.replace(path, name)
        return text


def error_body(message: str) -> bytes:
    """The body of every error answer: one line of JSON."""
    return json.dumps({"error": " ".join(str(message).split())}).encode()


def error_response(status: int, message: str, scrub: Scrubber | None = None) -> JSONResponse:
    """An error answer of the routes: `{"error": message}` with `status`, paths scrubbed."""
    text = scrub(str(message)) if scrub is not None else str(message)
    return JSONResponse({"error": " ".join(text.split())}, status_code=status)


def error_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of an error answer sent below the application (the guard's)."""
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]


def whole_number(value: str, what: str) -> int:
    """A path part naming a sequence, step, layer or head as an int; anything else is not there (NotFound).
    At most 18 digits: a longer number names nothing a run can hold (and int() refuses > 4,300 digits)."""
    number = _whole(value)
    if number is None:
        raise NotFound(f"{what} {_shown(value)!r} is not there: {what}s are numbered 0, 1, 2, …")
    return number


def int_parameter(value: str | None, name: str, default: int = 0) -> int:
    """A query parameter that must be a whole number (BadParameter otherwise)."""
    if value is None or value == "":
        return default
    number = _whole(value)
    if number is None:
        raise BadParameter(f"{name}={_shown(value)!r} is not a whole number")
    return number


def _whole(value: str) -> int | None:
    """`value` as an int when it is an optionally negative run of at most 18 ASCII digits, else None."""
    text = value.strip()
    digits = text[1:] if text.startswith("-") else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 18:
        return None
    return int(text)


def _shown(value: str) -> str:
    return value if len(value) <= 40 else value[:40] + "…"
