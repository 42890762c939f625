"""The playground: a chat page at ``GET /`` and its assets, served by the
server itself (no CDN, no build step).

Event loop only. The files are read once, when the routes are made, and
answered from memory with an ``ETag`` and a strict Content-Security-Policy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["ASSETS_PREFIX", "DIRECTORY", "PAGE", "SECURITY_HEADERS", "routes"]

#: The folder of the page and its assets, in the package.
DIRECTORY = Path(__file__).parent.parent / "playground"
#: The page's path, and the prefix of its assets' paths.
PAGE = "/"
ASSETS_PREFIX = "/playground/"

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

CSP = "; ".join(
    [
        "default-src 'none'",
        "img-src 'self' data: blob:",
        "media-src 'self' data: blob:",
        "style-src 'self'",
        "script-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

#: Sent with the page and with every asset.
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


@dataclass(frozen=True)
class _File:
    body: bytes
    content_type: str
    etag: str


def _read(directory: Path) -> dict[str, _File]:
    found = {}
    for path in sorted(directory.iterdir()):
        content_type = _CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.is_file():
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        found[path.name] = _File(body, content_type, etag)
    return found


def _answer(file: _File, request: Request) -> Response:
    # Revalidated on every load (no-cache), so a new version shows at once;
    # an unchanged file costs a 304.
    headers = {**SECURITY_HEADERS, "ETag": file.etag, "Cache-Control": "no-cache"}
    if file.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.content_type, headers=headers)


def routes(directory: Path = DIRECTORY) -> list[Route]:
    """The page (``index.html`` at ``/``) and its assets (every other file,
    under ``/playground/``), read from ``directory`` now."""
    files = _read(directory)
    if "index.html" not in files:
        raise FileNotFoundError(f"no index.html in {directory}")
    page = files.pop("index.html")
    assets: Mapping[str, _File] = files

    async def index(request: Request) -> Response:
        return _answer(page, request)

    async def asset(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None:
            raise HTTPException(404)
        return _answer(found, request)

    return [
        Route(PAGE, index, methods=["GET"]),
        Route(ASSETS_PREFIX + "{name}", asset, methods=["GET"]),
    ]
