"""Networking helpers every layer may use: free ports, and the address a service advertises
(docs/design.md#addresses): config, then env RLMESH_ADVERTISE_HOST, then the bound or routable host."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import re
import socket
import struct
from urllib.parse import urlsplit

log = logging.getLogger("rlmesh.runtime")

ENV_ADVERTISE_HOST = "RLMESH_ADVERTISE_HOST"
LOOPBACK = "127.0.0.1"
WILDCARD_IPV4 = "0.0.0.0"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "[::]"})
_SIOCGIFADDR = 0x8915
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?$")


def free_port(host: str = LOOPBACK, first: int = 0) -> int:
    """A TCP port free on ``host`` now (another process may still take it before it is bound):
    the OS's pick, or with ``first`` > 0 the lowest free one from ``first`` up (for a firewall
    that opens a range)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(first, 65536) if first > 0 else (0,):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host.strip("[]"), port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on {host} from {first} to 65535")


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; a wildcard is not (it binds every interface)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bracket(host: str) -> str:
    """``host`` as it goes before ``:port`` in an address or URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def dial_host(bind_host: str) -> str:
    """Where a process on this host reaches a server bound to ``bind_host``."""
    return LOOPBACK if is_wildcard(bind_host) else bind_host


def split_advertise(value: str, what: str) -> tuple[str, int | None]:
    """``host`` or ``host:port`` (IPv6 in brackets) -> (host, port or None); ``what`` names the key
    or variable in the error."""
    m = _HOST_PORT.match(value.strip())
    if m is None or (m.group(2) is not None and not 0 < int(m.group(2)) < 65536):
        raise ValueError(
            f"{what}={value!r}: expected host or host:port (an IPv6 literal in brackets: [fd00::1]:50053)"
        )
    host = m.group(1)
    if is_wildcard(host):
        raise ValueError(f"{what}={value!r}: a wildcard address is not one a peer can dial")
    return host, int(m.group(2)) if m.group(2) else None


def route_source(peer: str) -> str | None:
    """The local address this host sends from to reach ``peer`` (a UDP socket "connected" to it:
    the kernel picks the route, no packet is sent); None when there is no route or no such host."""
    peer = peer.strip("[]")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def _hostname_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def routable_host(redis_url: str) -> str:
    """This host's address for peers, when a service binds a wildcard and nothing names one: the
    source address of the route to the Redis host (every service reaches it), else the address the
    hostname resolves to, else loopback (nothing routable found; logged)."""
    redis_host = urlsplit(redis_url).hostname or ""
    for candidate in (
        route_source(redis_host) if redis_host and not is_loopback(redis_host) else None,
        _hostname_address(),
    ):
        if candidate and not is_loopback(candidate) and not is_wildcard(candidate):
            return candidate
    log.warning(
        "bound to a wildcard address, but no routable address found (Redis at %r is local, the "
        "hostname resolves to loopback): advertising %s; set %s or advertise_address",
        redis_host,
        LOOPBACK,
        ENV_ADVERTISE_HOST,
    )
    return LOOPBACK


def _advertised(
    bind_host: str, advertise: str | None, key: str, redis_url: str, environ: dict[str, str] | None
) -> tuple[str, int | None]:
    if advertise:
        return split_advertise(advertise, key)
    env = os.environ if environ is None else environ
    from_env = env.get(ENV_ADVERTISE_HOST, "").strip()
    if from_env:
        host, env_port = split_advertise(from_env, ENV_ADVERTISE_HOST)
        if env_port is not None:
            raise ValueError(
                f"{ENV_ADVERTISE_HOST}={from_env!r}: a host only (each service has its own port)"
            )
        return host, None
    return bracket(routable_host(redis_url) if is_wildcard(bind_host) else bind_host), None


def advertised_address(
    bind_host: str,
    port: int,
    *,
    advertise: str | None,
    key: str,
    redis_url: str,
    environ: dict[str, str] | None = None,
) -> str:
    """``host:port`` peers use for a service bound to ``bind_host:port``. Precedence: ``advertise``
    (config key ``key``: host, or host:port), env RLMESH_ADVERTISE_HOST (a host; the bound port),
    ``bind_host`` unless a wildcard, else :func:`routable_host`."""
    host, advertised_port = _advertised(bind_host, advertise, key, redis_url, environ)
    return f"{host}:{advertised_port or port}"


def advertised_host(
    bind_host: str,
    *,
    advertise: str | None,
    key: str,
    redis_url: str,
    environ: dict[str, str] | None = None,
) -> str:
    """The host of :func:`advertised_address` (an IPv6 literal without brackets)."""
    return _advertised(bind_host, advertise, key, redis_url, environ)[0].strip("[]")


def host_of(address: str) -> str:
    """The host of ``host:port`` (IPv6 without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")


class OpenBindError(RuntimeError):
    """A service would listen beyond loopback with no token, and nothing allowed it."""


def check_open_bind(bind_host: str, what: str, token: str | None, allow_open: bool = False) -> bool:
    """Refuses (``OpenBindError``) to let ``what`` bind beyond loopback with no auth token unless
    ``allow_open`` (``rlmesh.security.allow_open_bind``), which logs a warning instead; True when
    it binds open."""
    if is_loopback(bind_host) or token:
        return False
    where = bind_host or "0.0.0.0"
    if not allow_open:
        raise OpenBindError(
            f"{what} binds {where}, reachable from other hosts, and no rlmesh.auth_token is set: "
            "set rlmesh.auth_token (or env RLMESH_AUTH_TOKEN), bind 127.0.0.1, or set "
            "rlmesh.security.allow_open_bind=true to run it open on purpose"
        )
    log.warning(
        "%s binds %s without rlmesh.auth_token (rlmesh.security.allow_open_bind=true): anyone who "
        "can reach it can call it",
        what,
        where,
    )
    return True


def interface_of(address: str) -> str | None:
    """The network interface whose primary IPv4 address is ``address``; None for IPv6, loopback
    or an address no interface has."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    if is_loopback(address):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if raw[20:24] == packed:
                return name
    return None


def gloo_interface_toward(peer: str) -> str | None:
    """The interface gloo should use to be reachable by ``peer`` (its route's source interface);
    None = gloo's default (the hostname's address), which is right on loopback."""
    if is_loopback(peer):
        return None
    source = route_source(peer)
    return interface_of(source) if source else None
