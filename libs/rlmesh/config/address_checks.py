"""The form of a service's address (``host:port``) and an engine's URL, checked before anything, the
token included, is sent to one read from Redis or a config; never a host no service lives at
(link-local, where clouds serve instance credentials; unspecified; multicast). docs/security.md"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,253}$")


def check_address(address: str) -> str:
    """``address`` when it is ``host:port`` (IPv6 as ``[::1]:port``) with a port in 1..65535."""
    m = _HOST_PORT.match(address.strip()) if isinstance(address, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"not a host:port address: {address!r}")
    return address.strip()


def check_peer_address(address: str) -> str:
    """``address`` when it is a ``host:port`` a service of the run may listen at; else ValueError."""
    checked = check_address(address)
    _check_host(checked.rsplit(":", 1)[0].strip("[]"))
    return checked


def check_engine_url(url: str) -> str:
    """``url`` when it is an engine's base URL (http or https, a host, a port in 1..65535 when
    given, no user, query or fragment); else ValueError."""
    if not isinstance(url, str):
        raise ValueError(f"not an engine URL: {url!r}")
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = 0
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.query
        or parts.fragment
        or port == 0
    ):
        raise ValueError(f"not an engine URL http(s)://host:port: {url!r}")
    _check_host(parts.hostname)
    return url.strip()


def _check_host(host: str) -> None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOST_NAME.match(host):
            raise ValueError(f"not a host name: {host!r}") from None
        return
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local or ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{host} is a link-local, unspecified or multicast address: no service of the run")
