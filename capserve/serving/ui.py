"""The service's own web page at ``/ui``: one static HTML file (``ui/index.html``, package data) with its script and
style inline and the bundled examples (``ui/examples/*.png``) inlined as data URLs, served by ``PageApp``, an ASGI
app the service mounts. The page calls the API as any client does (``/model``, ``/classify``, ``/multilabel``,
``/explain``), so it has the API's limits, keys and error messages; it loads nothing from anywhere else, and its
Content-Security-Policy header forbids it to.

BentoML 1.4.40 serves only its generic page of the APIs at ``/`` (Swagger UI, or a form per API), none of a
service's own: the page is an ASGI app the service mounts with BentoML's ``mount_asgi_app``."""

from __future__ import annotations

import base64
import json
from importlib import resources
from typing import Any

from capserve.serving.guard import json_response

__all__ = ["CONTENT_SECURITY_POLICY", "EXAMPLES_MARKER", "PageApp", "page_html"]

# Everything the page needs is inline or from this server; nothing else may load (no CDN, font or tracker).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
    "connect-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


EXAMPLES_MARKER = "/*EXAMPLES*/[]"


def page_html() -> bytes:
    """The page with the bundled examples inlined: ``[{"name": ..., "src": "data:image/png;base64,..."}]``."""
    folder = resources.files("capserve.serving") / "ui"
    examples = [
        {
            "name": item.name.removesuffix(".png"),
            "src": "data:image/png;base64," + base64.b64encode(item.read_bytes()).decode(),
        }
        for item in sorted((folder / "examples").iterdir(), key=lambda item: item.name)
        if item.name.endswith(".png")
    ]
    html = (folder / "index.html").read_text(encoding="utf-8")
    assert EXAMPLES_MARKER in html, "ui/index.html lost its examples marker"
    return html.replace(EXAMPLES_MARKER, json.dumps(examples)).encode()


class PageApp:
    """ASGI app of the page: GET or HEAD of its root (``/ui`` or ``/ui/``) answers the page; any other method is a
    405 and any other path under it a 404, both in the service's one error shape."""

    def __init__(self) -> None:
        self.body = page_html()  # read once: the page never changes while the server runs

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        rest = path[len(root) :] if root and path.startswith(root) else path
        if rest not in ("", "/"):
            start, body = json_response(404, f"{path} is not a page of this server; the page is at {root or '/ui'}/")
        elif scope["method"] not in ("GET", "HEAD"):
            start, body = json_response(405, f"{scope['method']} {path}: the page answers GET only")
        else:
            headers = [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"content-length", str(len(self.body)).encode()),
                (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                (b"x-content-type-options", b"nosniff"),
                (b"cache-control", b"no-cache"),
            ]
            start = {"type": "http.response.start", "status": 200, "headers": headers}
            body = {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else self.body}
        await send(start)
        await send(body)
