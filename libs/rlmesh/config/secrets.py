"""Secrets in the config (the auth token, a Redis URL with a password) stay out of argv, logs and
files: a launcher hands them to its children in the environment, which only the same user can
read, where argv is visible to every user in ``ps``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

# A child reads these overrides (a JSON list of ``key=value``) after those in its argv.
SECRET_OVERRIDES_ENV = "RLMESH_SECRET_OVERRIDES"
SECRET_KEYS = frozenset({"rlmesh.auth_token"})
_SECRET_WORDS = ("token", "password", "passwd", "secret", "api_key")
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")


def redact_url(text: str) -> str:
    """``redis://user:pw@host`` -> ``redis://user:***@host``, anywhere in ``text``."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


def is_secret_override(override: str) -> bool:
    key, sep, value = override.partition("=")
    key = key.strip().lstrip("+~")
    if not sep or key.startswith("-") or "." not in key:  # only rlmesh config overrides
        return False
    leaf = key.rsplit(".", 1)[-1].lower()
    return key in SECRET_KEYS or any(w in leaf for w in _SECRET_WORDS) or redact_url(value) != value


def split_secret_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(public, secret)``: the overrides that may go in a child's argv, and those that go in
    its environment (:func:`secret_env`)."""
    public = [o for o in overrides if not is_secret_override(o)]
    secret = [o for o in overrides if is_secret_override(o)]
    return public, secret


def secret_env(secret: Sequence[str]) -> dict[str, str]:
    return {SECRET_OVERRIDES_ENV: json.dumps(list(secret))} if secret else {}


def secret_overrides_from_env() -> list[str]:
    raw = os.environ.get(SECRET_OVERRIDES_ENV)
    if not raw:
        return []
    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{SECRET_OVERRIDES_ENV} must be a JSON list of key=value strings")
    return value


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` fit for a log line: a secret override's value and URL passwords replaced."""
    return [
        f"{a.partition('=')[0]}=***" if is_secret_override(a) and redact_url(a) == a else redact_url(a)
        for a in argv
    ]
