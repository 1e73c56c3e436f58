"""Client-side health probes: gRPC grpc.health.v1, Redis PING, Prometheus /metrics."""

from __future__ import annotations

import socket
import ssl
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.runtime.tls import https_context, sync_channel


def grpc_health(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """Returns the serving status name (SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN) or
    ``UNREACHABLE: <reason>`` when no answer came."""
    with sync_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return f"UNREACHABLE: {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def resp_command(*args: str) -> bytes:
    """One command as a RESP array (any bytes in its arguments, unlike an inline command)."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def redis_ping(
    host: str,
    port: int,
    timeout_s: float = 1.0,
    *,
    username: str | None = None,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
    any_reply: bool = False,
) -> bool:
    """True when a Redis server answers PING on host:port (raw RESP, no client library), after
    AUTH with ``password`` (and ``username``, an ACL user) and over ``tls`` when given.
    ``any_reply``: an error reply counts too (NOAUTH from a server whose default user is off: it
    serves, this probe just has no user)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            sock = tls.wrap_socket(raw, server_hostname=host) if tls else raw
            if password is not None:
                sock.sendall(resp_command("AUTH", *([username] if username else []), password))
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
            return reply.startswith(b"+PONG") or (any_reply and reply.startswith(b"-"))
    except OSError:  # ssl.SSLError among them
        return False


def scrape_metrics(host: str, port: int, timeout_s: float = 2.0) -> str:
    """The text of a Prometheus ``/metrics`` page."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=https_context(url)) as resp:
            return resp.status == 200
    except OSError:
        return False
