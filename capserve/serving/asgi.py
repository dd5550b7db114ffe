"""ASGI plumbing the guard and the OpenAPI rewrite share: a response held and rewritten, a body given once, headers
replaced. BentoML 1.4.40 has no hook on its answers or its request bodies (``api_endpoint_wrapper`` builds the one,
its serdes read the other), so the guard rewrites them as they pass."""

from __future__ import annotations

from typing import Any

__all__ = ["body_once", "replace_headers", "rewrite_response"]


def rewrite_response(send: Any, holds: Any, rewrite: Any) -> Any:
    """An ASGI send() that holds a response whose start message ``holds(start)`` accepts, collects its whole body,
    and sends what ``rewrite(start, body)`` returns instead, as (start, body) messages; other responses pass
    through untouched."""
    held: dict[str, Any] = {}

    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start" and holds(message):
            held["start"], held["body"] = message, b""
            return None
        if "start" not in held or message["type"] != "http.response.body":
            return await send(message)
        held["body"] += message.get("body", b"")
        if message.get("more_body", False):
            return None
        start, body = rewrite(held.pop("start"), held.pop("body"))
        await send(start)
        await send(body)

    return wrapped


def body_once(body: bytes, then: Any = None) -> Any:
    """An ASGI receive() that gives ``body`` once, then defers to ``then`` (the real one: disconnects)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


def replace_headers(raw: list, content_type: str, length: int) -> list:
    """ASGI headers ``raw`` with their Content-Type and Content-Length replaced."""
    kept = [(k, v) for k, v in raw if k.lower() not in (b"content-type", b"content-length")]
    return [*kept, (b"content-type", content_type.encode()), (b"content-length", str(length).encode())]
