"""Bearer-token auth for HTTP (the engines' API and the control plane's), as SGLang's ``--api-key``
does it: 401 without ``Authorization: Bearer <token>``, but for the probes and /metrics; and the
header a client sends. docs/design.md#tokens"""

from __future__ import annotations

import hmac
import json

from rlmesh.runtime.http_guard import ASGIApp, Receive, Scope, Send

# Open as in SGLang, so that orchestrators and scrapers need no secret. Exact paths, not SGLang's
# prefixes: a prefix would also open any route added later under it.
OPEN_PATHS: frozenset[str] = frozenset({"/health", "/health_generate", "/metrics"})


def bearer_headers(token: str | None) -> dict[str, str]:
    """The header an engine client sends; none without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class BearerTokenMiddleware:
    """Plain ASGI (not Starlette's BaseHTTPMiddleware, which buffers each response through a task
    and hides a client's disconnect from the route): a refused request is answered before its body
    is read, an accepted one passes through untouched."""

    def __init__(self, app: ASGIApp, *, token: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        if not token:
            raise ValueError("BearerTokenMiddleware needs a non-empty token")
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._open_paths = open_paths

    def _refusal(self, scope: Scope) -> str | None:
        """Why the request is refused; None when it may pass."""
        if scope["path"] in self._open_paths:
            return None
        for key, value in scope["headers"]:
            if key == b"authorization":
                return None if hmac.compare_digest(value, self._expected) else "invalid bearer token"
        return "missing 'Authorization: Bearer <token>' header"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        reason = self._refusal(scope)
        if reason is None:
            await self.app(scope, receive, send)
            return
        # SGLang's body ({"error": "Unauthorized"}), and what was wrong, for a person reading it.
        body = json.dumps({"error": "Unauthorized", "message": f"{scope['path']}: {reason}"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
