"""The env service's ASGI guard: the token check (401) and the request-body cap (413), before FastAPI."""

from __future__ import annotations

import hmac
import json

from fedagent.envs.client import TOKEN_HEADER


class GuardMiddleware:
    """Pure ASGI middleware: token check (401) and request-body cap (413).

    Pure ASGI rather than ``@app.middleware`` because Starlette's BaseHTTPMiddleware may
    cancel the endpoint when the client disconnects, which would break the
    "a started step always completes" guarantee. ``path_caps`` overrides the cap per path
    (the batch route carries many answers).
    """

    def __init__(self, app, *, max_body: int, token: str | None, path_caps: dict[str, int] | None = None):
        """Wrap ``app``."""
        self.app, self.default_cap, self.token = app, max_body, token
        self.path_caps = dict(path_caps or {})

    async def __call__(self, scope, receive, send):
        """Reject early by headers, then count streamed body bytes."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_body = self.path_caps.get(scope.get("path", ""), self.default_cap)
        headers = dict(scope.get("headers") or [])
        if self.token is not None:
            given = headers.get(TOKEN_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.token.encode()):
                return await _plain(send, 401, "missing or wrong token")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > max_body
            except ValueError:
                return await _plain(send, 400, "bad content-length")
            if too_big:
                return await _plain(send, 413, f"request body over {max_body} bytes")
        # Buffer the (bounded) body before the app sees it, so an oversized chunked body is
        # a clean 413 instead of a parse error deep inside FastAPI.
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away before the body
            body += message.get("body", b"")
            if len(body) > max_body:
                return await _plain(send, 413, f"request body over {max_body} bytes")
            more = message.get("more_body", False)
        replayed = False

        async def buffered_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, buffered_receive, send)


async def _plain(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
