"""Secrets in the config (the token, passwords) stay out of argv, logs and files: children get them
in the environment, which only their user reads (``ps`` shows argv to all), and what is shown or
stored of a config is :func:`public_config`."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

# A child reads these overrides (a JSON list of ``key=value``) after those in its argv.
SECRET_OVERRIDES_ENV = "RLMESH_SECRET_OVERRIDES"
SECRET_KEYS = frozenset({"rlmesh.auth_token"})
MASK = "***"
# A leaf named like a secret: ``token``/``*_token`` (not ``max_tokens``, a count), any password,
# secret, api key or credential.
_SECRET_LEAF = re.compile(r"(^|_)token$|password|passwd|secret|api_?key|credential", re.IGNORECASE)
# ``scheme://user:password@``: the password runs to the last ``@`` before the path, so one with an
# unencoded ``@`` is masked whole.
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s?#]*):(?P<password>[^/\s?#]*)@")
# ``?password=…`` / ``&api_key=…`` (redis-py takes a password as a query parameter too).
_URL_QUERY_SECRET = re.compile(
    r"(?P<key>[?&][^=&#\s]*(?:token|password|passwd|pwd|secret|api_?key)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE
)


def redact_url(text: str) -> str:
    """``redis://user:pw@host`` -> ``redis://user:***@host`` and ``?password=pw`` -> ``?password=***``,
    anywhere in ``text``."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _URL_QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", text)


def is_secret_key(key: str) -> bool:
    """A dotted config key whose value is a secret: ``rlmesh.auth_token``, or any key whose leaf is
    named like one (``hf_token``, ``redis_password``, ``client_secret``, ``api_key``)."""
    key = key.strip().lstrip("+~")
    return key in SECRET_KEYS or bool(_SECRET_LEAF.search(key.rsplit(".", 1)[-1]))


def _redact(value: Any, key: str) -> Any:
    if is_secret_key(key) and value not in (None, ""):
        return MASK
    if isinstance(value, Mapping):
        return {k: _redact(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(v, key) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value


def public_config(config: BaseModel | Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as it may be shown or stored anywhere (the learner's published copy,
    ``/api/v1/run/config``, a checkpoint's ``config.yaml``, the trackers): plain JSON data in which
    every set secret (:func:`is_secret_key`) reads ``***`` and every password in a URL is masked.
    ``config``: an ``RLMeshConfig`` or its ``model_dump(mode="json")``."""
    if isinstance(config, BaseModel):
        config = config.model_dump(mode="json")
    return _redact(dict(config or {}), "")


def is_secret_override(override: str) -> bool:
    key, sep, value = override.partition("=")
    key = key.strip().lstrip("+~")
    if not sep or key.startswith("-") or "." not in key:  # only rlmesh config overrides
        return False
    return is_secret_key(key) or redact_url(value) != value


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
        f"{a.partition('=')[0]}={MASK}" if is_secret_override(a) and redact_url(a) == a else redact_url(a)
        for a in argv
    ]
