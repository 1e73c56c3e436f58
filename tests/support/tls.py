"""Certificates for TLS tests, made with the openssl command line: a CA and a certificate it signs
for loopback (127.0.0.1 and localhost), good for a server and a client alike."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSFiles:
    ca_file: Path
    cert_file: Path
    key_file: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")


def make_tls_files(directory: Path, name: str = "test") -> TLSFiles:
    """A fresh CA named ``name`` in ``directory`` and a loopback certificate it signed."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (
        f"{name}-{f}" for f in ("ca.key", "ca.crt", "key.pem", "csr.pem", "crt.pem")
    )
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
             "-days", "2", "-subj", f"/CN={name} CA", cwd=directory)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
             "-subj", "/CN=localhost", cwd=directory)  # fmt: skip
    (directory / f"{name}-san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
             "-days", "2", "-extfile", f"{name}-san.ext", cwd=directory)  # fmt: skip
    return TLSFiles(ca_file=directory / ca, cert_file=directory / cert, key_file=directory / key)
