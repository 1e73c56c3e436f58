"""Client-side health probes: gRPC grpc.health.v1, Redis PING, Prometheus /metrics."""

from __future__ import annotations

import socket
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_health(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """Returns the serving status name (SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN) or
    ``UNREACHABLE: <reason>`` when no answer came."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return f"UNREACHABLE: {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def redis_ping(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when a Redis server answers PING on host:port (raw RESP, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def scrape_metrics(host: str, port: int, timeout_s: float = 2.0) -> str:
    """The text of a Prometheus ``/metrics`` page."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False
