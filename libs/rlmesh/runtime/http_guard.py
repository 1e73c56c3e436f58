"""The guard in front of rlmesh's HTTP services (engine, control plane), as plain ASGI: Host and
Origin checks, JSON-only changes, body limits while reading, and the security headers on every
answer. docs/security.md#http"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# (status, message) -> the JSON body of a refusal, in the shape the service's clients read.
ErrorBody = Callable[[int, str], dict[str, Any]]

ANY = "*"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost"})
# The service's own files and API calls, nothing else: no plugins, no <base>, no framing.
CSP = "default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
# FastAPI's API pages load Swagger UI and ReDoc from their CDN and start them with an inline script,
# allowed by its hash (computed from the page served); ReDoc adds <style> elements as it renders.
DOC_PAGES = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})
DOCS_CSP = (
    "default-src 'none'; script-src https://cdn.jsdelivr.net{scripts}; "
    "style-src https://cdn.jsdelivr.net https://fonts.googleapis.com 'unsafe-inline'; "
    "img-src 'self' data: https://fastapi.tiangolo.com https://cdn.jsdelivr.net; "
    "font-src https://fonts.gstatic.com; connect-src 'self'; worker-src blob:; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_INLINE_SCRIPT = re.compile(rb"<script(?![^>]*\bsrc\s*=)[^>]*>(.*?)</script>", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class GuardPolicy:
    """What a service accepts; build it with :func:`guard_policy`."""

    hosts: frozenset[str]  # names it answers to besides loopback and IP literals; "*": any
    origins: frozenset[str]  # origins besides its own that may change state; "*": any
    max_body_bytes: int
    json_bodies_only: bool  # a body with no Content-Type is refused too (not only a non-JSON one)
    hosts_setting: str  # where an operator allows another host, named in the refusal
    origins_setting: str


def host_name(value: str) -> str:
    """The host of a Host header, a bind address or an allowed_hosts entry, lower case, without its
    port or brackets: ``[::1]:80`` -> ``::1``, ``Control:8000`` -> ``control``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:  # host:port; more colons: a bare IPv6 literal (a bind address)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def guard_policy(
    *,
    own_hosts: Iterable[str],
    allowed_hosts: Iterable[str] = (),
    allowed_origins: Iterable[str] = (),
    max_body_bytes: int,
    json_bodies_only: bool = False,
    hosts_setting: str = "rlmesh.security.allowed_hosts",
    origins_setting: str = "rlmesh.security.allowed_origins",
) -> GuardPolicy:
    """``own_hosts``: the service's bind and advertised hosts (ports and wildcards are fine: a port
    is dropped, a wildcard names nothing); this machine's hostname is added."""
    names = {host_name(h) for h in (*own_hosts, *allowed_hosts, socket.gethostname()) if h.strip()}
    return GuardPolicy(
        hosts=frozenset(names - {"", "0.0.0.0", "::"}),
        origins=frozenset(o.strip().lower().rstrip("/") for o in allowed_origins if o.strip()),
        max_body_bytes=max_body_bytes,
        json_bodies_only=json_bodies_only,
        hosts_setting=hosts_setting,
        origins_setting=origins_setting,
    )


def host_allowed(policy: GuardPolicy, host: str) -> bool:
    """A DNS-rebinding page reaches this service under the attacker's name, so names must be known;
    an IP literal never comes from one (the browser sends the name it resolved), so any passes."""
    name = host_name(host)
    return ANY in policy.hosts or name in policy.hosts or name in LOOPBACK_NAMES or is_ip(name)


def origin_allowed(policy: GuardPolicy, origin: str, scheme: str, host: str | None) -> bool:
    """The service's own origin (the page it served, as the browser reached it), or an allowed one.
    ``null`` (a sandboxed frame, a redirect, a page with no-referrer) is no one's origin."""
    origin = origin.strip().lower().rstrip("/")
    own = f"{scheme}://{host.strip().lower()}" if host else None
    return origin == own or ANY in policy.origins or origin in policy.origins


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def refusal(policy: GuardPolicy, scope: Scope) -> tuple[int, str] | None:
    """(status, why) when the request is refused before the app sees it; None when it may pass.
    Checked on the headers alone: nothing of the body is read."""
    # The first of a repeated header, as Starlette reads it.
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}
    host, method = headers.get("host"), scope["method"]
    # No Host at all is an HTTP/1.0 client; a browser always sends one.
    if host is not None and not host_allowed(policy, host):
        return 421, (
            f"Host {host!r} is not a name this service answers to (loopback, an IP address, its own "
            f"host names); if the name is yours, add it to {policy.hosts_setting}"
        )
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > policy.max_body_bytes:
        return 413, f"request body is {int(length)} bytes; this service takes at most {policy.max_body_bytes}"
    if method in SAFE_METHODS:
        return None
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(policy, origin, scope.get("scheme", "http"), host):
        return 403, (
            f"Origin {origin!r} may not send {method} requests to this service (cross-site request "
            f"refused); a page of yours on another origin: add it to {policy.origins_setting}"
        )
    content_type = headers.get("content-type")
    has_body = (length is not None and length != "0") or "transfer-encoding" in headers
    if (content_type is not None and not is_json(content_type)) or (
        content_type is None and has_body and policy.json_bodies_only
    ):
        return 415, f"Content-Type {content_type!r}: a {method} body must be application/json"
    return None


def security_headers(csp: str = CSP) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-security-policy", csp.encode()),
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"cross-origin-resource-policy", b"same-origin"),
    ]


def docs_csp(html: bytes) -> str:
    """The API pages' policy: their CDN, and each inline script of ``html`` by its hash."""
    hashes = [base64.b64encode(hashlib.sha256(s).digest()).decode() for s in _INLINE_SCRIPT.findall(html)]
    return DOCS_CSP.format(scripts="".join(f" 'sha256-{h}'" for h in hashes))


def detail_body(status: int, message: str) -> dict[str, Any]:
    """FastAPI's shape: ``{"detail": ...}``."""
    return {"detail": message}


async def respond(
    send: Send, status: int, message: str, error_body: ErrorBody, headers: list[tuple[bytes, bytes]]
) -> None:
    body = json.dumps(error_body(status, message)).encode()
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 413:  # what is left of the body is not read: the client must not send on
        start_headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": [*start_headers, *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    """Raised into the app by ``receive`` once the body passes the limit; the guard answers 413."""


class _Exchange:
    """One request through the guard: the body bytes read so far (counted as they arrive), whether
    the answer has begun, and an API page's answer held until its CSP can be computed."""

    def __init__(self, limit: int, path: str, receive: Receive, send: Send) -> None:
        self.limit = limit
        self.received = 0
        self.too_large = False
        self.started = False
        self._receive = receive
        self._send = send
        self._doc_page = path in DOC_PAGES
        self._held: Message | None = None
        self._body = b""

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.too_large = True
                raise BodyTooLarge(f"request body passed {self.limit} bytes")
        return message

    async def send(self, message: Message) -> None:
        if self.too_large:
            return  # the app's answer to a body it could not read: the guard's 413 goes instead
        if message["type"] == "http.response.start":
            self.started = True
            if self._doc_page:
                self._held = message
                return
            message = {**message, "headers": [*message.get("headers", []), *security_headers()]}
        elif self._held is not None and message["type"] == "http.response.body":
            self._body += message.get("body", b"")
            if message.get("more_body", False):
                return
            start, self._held = self._held, None
            headers = [*start.get("headers", []), *security_headers(docs_csp(self._body))]
            await self._send({**start, "headers": headers})
            message = {"type": "http.response.body", "body": self._body}
        await self._send(message)


class HttpGuard:
    """Plain ASGI (not BaseHTTPMiddleware, which runs the app in a task and buffers its answers): a
    refused request is answered from its headers alone, an accepted one passes with its body
    counted as it streams in (a chunked body included) and stopped with a 413 past the limit."""

    def __init__(self, app: ASGIApp, *, policy: GuardPolicy, error_body: ErrorBody = detail_body) -> None:
        self.app = app
        self.policy = policy
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan; these apps serve no websocket
            await self.app(scope, receive, send)
            return
        refused = refusal(self.policy, scope)
        if refused is not None:
            await respond(send, *refused, self.error_body, security_headers())
            return
        exchange = _Exchange(self.policy.max_body_bytes, scope["path"], receive, send)
        # Answered below; or, the answer begun, the connection ends unfinished.
        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, exchange.receive, exchange.send)
        if exchange.too_large and not exchange.started:
            limit = self.policy.max_body_bytes
            message = f"request body is over {limit} bytes; this service takes at most {limit}"
            await respond(send, 413, message, self.error_body, security_headers())


def http_limits(max_concurrency: int, keep_alive_timeout_s: float) -> dict[str, Any]:
    """uvicorn.Config's limits: ``max_concurrency`` requests at once (more get a 503) and an idle
    keep-alive connection closed after ``keep_alive_timeout_s``. uvicorn counts open connections
    against its limit, the asking one included: one more lets ``max_concurrency`` through."""
    if max_concurrency < 1 or not keep_alive_timeout_s > 0:
        raise ValueError(
            f"max_concurrency={max_concurrency} (>= 1), keep-alive {keep_alive_timeout_s} s (> 0)"
        )
    return {"limit_concurrency": max_concurrency + 1, "timeout_keep_alive": keep_alive_timeout_s}
