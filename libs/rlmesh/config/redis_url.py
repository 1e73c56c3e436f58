"""What ``rlmesh.redis_url`` may be: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…``
(TLS) with the TLS files as query parameters, or ``unix://path``. Checked when the config loads and
again where a client connects (the files then: the config may be read on another machine)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from rlmesh.config.secrets import redact_url

SCHEMES = ("redis", "rediss", "unix")
# Query parameters redis-py hands to its TLS connection, and what each must name.
TLS_FILES = {
    "ssl_ca_certs": "file",
    "ssl_certfile": "file",
    "ssl_keyfile": "file",
    "ssl_ca_path": "directory",
}
TLS_OPTIONS = {
    "ssl_cert_reqs": ("none", "optional", "required"),
    "ssl_check_hostname": ("true", "false", "yes", "no", "1", "0"),
}


def redis_url_problem(url: str, *, check_files: bool = False) -> str | None:
    """Why ``url`` cannot be used (its password masked), or None. ``check_files``: the TLS files it
    names must exist here."""
    parsed = urlparse(url)
    shown = redact_url(url)
    with contextlib.suppress(ValueError):
        # A password with characters it should have percent-encoded defeats redact_url's pattern.
        if parsed.password:
            shown = shown.replace(parsed.password, "***")
    if parsed.scheme not in SCHEMES:
        return f"{shown!r}: expected redis://[[user]:password@]host:port/db, rediss://… (TLS) or unix://path"
    # Not shown from here: where the host cannot be found, nor can the password be to mask it.
    unparsed = (
        f"'{parsed.scheme}://…' (shown no further, in case it holds a password): no host:port found; "
        "characters such as @ / ? # : in a user or password must be %-encoded"
    )
    if parsed.scheme != "unix" and not parsed.hostname:
        return unparsed
    try:
        parsed.port  # noqa: B018 - raises for a port that is no number
    except ValueError:
        return unparsed
    query = parse_qs(parsed.query)
    tls_params = sorted(k for k in query if k in TLS_FILES or k in TLS_OPTIONS)
    if tls_params and parsed.scheme != "rediss":
        return f"{shown!r}: {', '.join(tls_params)} configure TLS, which needs rediss://"
    for name, allowed in TLS_OPTIONS.items():
        value = query.get(name, [allowed[-1]])[0]
        if value.lower() not in allowed:
            return f"{shown!r}: {name}={value!r}, expected one of {', '.join(allowed)}"
    if check_files:
        for name, kind in TLS_FILES.items():
            for value in query.get(name, []):
                path = Path(value)
                if not (path.is_dir() if kind == "directory" else path.is_file()):
                    return f"{shown!r}: {name}={value!r} is not a {kind} here"
    return None
