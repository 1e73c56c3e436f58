"""Optional TLS between services: one certificate and key per process, one CA every peer is checked
against, and with ``verify_clients`` mutual TLS. The files travel to a process's clients and children
in its environment, as the token does (runtime/entry.py exports them). docs/security.md#tls"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rlmesh.config.loader import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_VERIFY_CLIENTS
from rlmesh.config.rlmesh_section import TlsConfig


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    ca_file: str
    verify_clients: bool = False

    def check(self) -> None:
        """Raises ``FileNotFoundError`` naming the first file that cannot be read."""
        for what, path in (("certificate", self.cert_file), ("key", self.key_file), ("CA", self.ca_file)):
            if not Path(path).is_file():
                raise FileNotFoundError(f"TLS {what} file {path!r} does not exist or is not a file")


def tls_of(config: TlsConfig) -> TlsFiles | None:
    if not config.enabled:
        return None
    assert config.cert_file and config.key_file and config.ca_file  # TlsConfig: all or none
    return TlsFiles(config.cert_file, config.key_file, config.ca_file, config.verify_clients)


def tls_from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    env = os.environ if environ is None else environ
    cert, key, ca = env.get(ENV_TLS_CERT), env.get(ENV_TLS_KEY), env.get(ENV_TLS_CA)
    if not (cert and key and ca):
        return None
    return TlsFiles(cert, key, ca, env.get(ENV_TLS_VERIFY_CLIENTS, "") in ("1", "true", "yes"))


def export_tls(files: TlsFiles | None, environ: MutableMapping[str, str] | None = None) -> None:
    """Puts ``files`` where this process's clients and children read them (none: removes them)."""
    env = os.environ if environ is None else environ
    if files is None:
        for name in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA, ENV_TLS_VERIFY_CLIENTS):
            env.pop(name, None)
        return
    env[ENV_TLS_CERT], env[ENV_TLS_KEY], env[ENV_TLS_CA] = files.cert_file, files.key_file, files.ca_file
    env[ENV_TLS_VERIFY_CLIENTS] = "1" if files.verify_clients else "0"


@functools.cache
def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(_read(files.key_file), _read(files.cert_file))],
        root_certificates=_read(files.ca_file),
        require_client_auth=files.verify_clients,
    )


def grpc_channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    # A client always presents its certificate: a server that checks clients needs it, one that
    # does not ignores it.
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca_file),
        private_key=_read(files.key_file),
        certificate_chain=_read(files.cert_file),
    )


def aio_channel(
    address: str,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    tls: TlsFiles | None = None,
) -> grpc.aio.Channel:
    """A channel to ``address``: TLS with ``tls`` (default: this process's, from its environment)."""
    files = tls if tls is not None else tls_from_env()
    if files is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, grpc_channel_credentials(files), options=options, interceptors=interceptors
    )


def sync_channel(address: str, *, tls: TlsFiles | None = None) -> grpc.Channel:
    """The blocking counterpart of :func:`aio_channel` (health probes, the CLI)."""
    files = tls if tls is not None else tls_from_env()
    if files is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc_channel_credentials(files))


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=files.ca_file)
    context.load_cert_chain(files.cert_file, files.key_file)
    context.verify_mode = ssl.CERT_REQUIRED if files.verify_clients else ssl.CERT_NONE
    return context


def client_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=files.ca_file)
    context.load_cert_chain(files.cert_file, files.key_file)
    return context


def https_context(url: str) -> ssl.SSLContext | None:
    """The client context an ``https://`` URL is reached with: the run's CA and this process's
    certificate (from its environment); None for plain HTTP or no TLS settings (system CAs)."""
    files = tls_from_env() if url.startswith("https:") else None
    return client_ssl_context(files) if files else None


def uvicorn_ssl(files: TlsFiles | None) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that serve HTTPS with ``files`` ({} for plain HTTP)."""
    if files is None:
        return {}
    return {
        "ssl_certfile": files.cert_file,
        "ssl_keyfile": files.key_file,
        "ssl_ca_certs": files.ca_file,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if files.verify_clients else ssl.CERT_NONE,
    }


def http_scheme(files: TlsFiles | None = None) -> str:
    return "https" if (files if files is not None else tls_from_env()) else "http"
