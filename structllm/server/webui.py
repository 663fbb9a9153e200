"""The chat page at ``/``: static files shipped in ``structllm/web`` (HTML, CSS and plain
JavaScript; no build step, nothing fetched from elsewhere).

The page is a client of the API like any other: it calls ``/v1/models``,
``/v1/chat/completions`` and ``/metrics`` from the browser, with the API key as a bearer
token when the server has one. Serving its files therefore needs neither the key (they
hold no secret) nor the engine: the bytes are read once, when the app is built, and
answered from memory. ``--no-web-ui`` leaves these routes out (404).
"""

from __future__ import annotations

from importlib import resources

# route -> (file in structllm/web, content type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}

# The page runs only its own script and style, talks only to its own origin, and may not
# be framed: model text is inserted as text, and this is the second line of defence.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


class StaticFile:
    """One file of the page, in memory."""

    def __init__(self, body: bytes, content_type: str) -> None:
        self.body = body
        self.headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
            *SECURITY_HEADERS,
        ]


def load_files() -> dict[str, StaticFile]:
    """The page's files by route, read from the installed package."""
    web = resources.files("structllm") / "web"
    return {
        route: StaticFile((web / name).read_bytes(), ctype)
        for route, (name, ctype) in FILES.items()
    }
