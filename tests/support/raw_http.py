"""HTTP/1.1 on a plain socket, for what an HTTP client library will not do: declare a body and send
none of it, send a chunked body without its end, hold connections open. ``http.client`` reads the
answers."""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=120)


def read_answer(sock: socket.socket, method: str = "GET") -> Answer:
    response = http.client.HTTPResponse(sock, method=method)
    response.begin()
    headers = {k.lower(): v for k, v in response.getheaders()}
    return Answer(response.status, headers, response.read())


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def declared_only(url: str, path: str, length: int, headers: dict[str, str]) -> Answer:
    """A POST that declares ``length`` body bytes and sends none: the answer comes from the
    headers alone, or never (the socket's timeout fails the test)."""
    with connect(url) as sock:
        sock.sendall(head("POST", path, {**headers, "Content-Length": str(length)}))
        return read_answer(sock, "POST")


def chunked_unfinished(
    url: str, path: str, size: int, headers: dict[str, str], chunk: int = 1 << 20
) -> Answer:
    """A chunked POST of ``size`` bytes without its closing chunk: an answer means the server
    stopped reading at a limit, not at the body's end."""
    with connect(url) as sock:
        sock.sendall(head("POST", path, {**headers, "Transfer-Encoding": "chunked"}))
        block = b"1" * chunk
        sent = 0
        while sent < size:
            n = min(chunk, size - sent)
            sock.sendall(f"{n:x}\r\n".encode() + block[:n] + b"\r\n")
            sent += n
        return read_answer(sock, "POST")


@contextlib.contextmanager
def held_connections(url: str, host: str, most: int) -> Iterator[list[int]]:
    """Opens connections one at a time, each asking ``GET /health`` and staying open, until one is
    answered 503 or ``most`` are; yields the statuses in order, and closes them all after."""
    socks: list[socket.socket] = []
    statuses: list[int] = []
    try:
        while len(statuses) < most and 503 not in statuses:
            sock = connect(url)
            socks.append(sock)
            sock.sendall(head("GET", "/health", {"Host": host}))
            statuses.append(read_answer(sock).status)
        yield statuses
    finally:
        for sock in socks:
            sock.close()
