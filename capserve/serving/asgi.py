"""ASGI plumbing the guard and the OpenAPI rewrite share."""

from __future__ import annotations

from typing import Any


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
