"""Loading: built-in defaults <- YAML file <- dotted overrides, `${...}` resolved, then validation.

docs/internals.md#rlmeshconfigloader"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import ValidationError

from rlmesh.config.base import ConfigWarning
from rlmesh.config.errors import ConfigError, format_validation_error
from rlmesh.config.ignored import ignored_given, ignored_message
from rlmesh.config.key_catalog import config_keys
from rlmesh.config.placement import PlacementError, reference_on_gpu, split_gpus
from rlmesh.config.schema import RLMeshConfig
from rlmesh.config.secrets import public_config, redact_argv, secret_overrides_from_env
from rlmesh.config.verl_map import ENGINE_KEY, drop_legacy_nulls, map_verl_keys, mapped_message

ENV_AUTH_TOKEN = "RLMESH_AUTH_TOKEN"
ENV_REDIS_PASSWORD = "RLMESH_REDIS_PASSWORD"


@functools.cache
def _defaults_tree() -> dict[str, Any]:
    # The defaults as plain data, so a YAML file's `${data.max_prompt_length}` resolves even when the
    # file does not set it. model_construct skips the root validator: derived keys stay null here
    # and follow their source key after the file and overrides are applied.
    tree = RLMeshConfig.model_construct().model_dump(mode="json")
    for item in config_keys():
        if item.aliases:
            # Left out so that a user's alias (warmup_ratio) does not look like a second value.
            *parents, leaf = item.key.split(".")
            node = tree
            for part in parents:
                node = node[part]
            node.pop(leaf, None)
    return tree


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    # Mappings merge key by key; anything else (lists included) replaces, as OmegaConf.merge does.
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        elif value is None and isinstance(base.get(key), dict):
            continue  # verl writes `section: null` for "not customised" (e.g. rollout_correction): keep defaults
        else:
            base[key] = copy.deepcopy(value)


def _read_file(path: str | os.PathLike[str], problems: list[str]) -> dict[str, Any]:
    if not Path(path).is_file():
        problems.append(f"config file not found: {os.fspath(path)}")
        return {}
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        problems.append(f"cannot parse config file {os.fspath(path)}: {e}")
        return {}
    if not isinstance(loaded, DictConfig):
        problems.append(f"config file {os.fspath(path)} must hold a mapping of keys at the top, not a list")
        return {}
    return OmegaConf.to_container(loaded, resolve=False)  # type: ignore[return-value]


def _parse_override(arg: str, index: int, problems: list[str]) -> dict[str, Any] | None:
    shown = redact_argv([arg])[0]  # an error message must not carry a secret either
    where = f"override #{index} {shown!r}"
    key, sep, value = arg.partition("=")
    key = key.strip()
    # Hydra's `+key` (add) and `++key` (add or override) mean the same here: every key is known.
    bare = key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key
    if not sep:
        problems.append(f"{where} has no '=': write key=value, e.g. data.train_batch_size=64")
        return None
    if bare.startswith("~"):
        problems.append(f"{where}: deleting a key (~key) is not supported; set it to a value instead")
        return None
    if not bare or any(not part for part in bare.split(".")):
        problems.append(f"{where} has an empty key (or an empty part between dots)")
        return None
    try:
        parsed = OmegaConf.from_dotlist([f"{bare}={value}"])
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problems.append(f"{where}: cannot parse the value {shown.partition('=')[2]!r}: {first_line}")
        return None
    return OmegaConf.to_container(parsed, resolve=False)  # type: ignore[return-value]


@functools.cache
def _compat_keys() -> tuple[str, ...]:
    return tuple(item.key for item in config_keys() if item.compat)


def _inside_compat_key(path: str) -> bool:
    return any(path == key or path.startswith((f"{key}.", f"{key}[")) for key in _compat_keys())


def _resolve(node: Any, path: str, problems: list[str]) -> Any:
    """Plain data with every `${...}` resolved; each unresolvable key is reported, not just the first."""
    if isinstance(node, DictConfig):
        items: list[tuple[Any, str]] = [(k, f"{path}.{k}" if path else str(k)) for k in node]
    elif isinstance(node, ListConfig):
        items = [(i, f"{path}[{i}]") for i in range(len(node))]
    else:
        return node
    out: dict[Any, Any] = {}
    for key, full in items:
        try:
            child = node[key]
        except MissingMandatoryValue:
            if _inside_compat_key(full) or full == ENGINE_KEY:
                # verl's "required" marker under a key rlmesh ignores, or on the engine, which
                # rlmesh picks itself when it is not set (verl_map)
                out[key] = None
            else:
                problems.append(f"'{full}' is '???' (verl's marker for a required value): set it")
            continue
        except OmegaConfBaseException as e:
            raw = node._get_node(key)._value()  # the `${...}` text as written
            reason = str(e).strip().splitlines()[0]
            problems.append(f"cannot resolve '{full}' = {raw!r}: {reason}")
            continue
        out[key] = _resolve(child, full, problems)
    return list(out.values()) if isinstance(node, ListConfig) else out


def _has_markers(node: Any) -> bool:
    if isinstance(node, str):
        return "${" in node or node == "???"
    if isinstance(node, Mapping):
        return any(_has_markers(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_markers(v) for v in node)
    return False


def _apply_env_token(data: dict[str, Any]) -> None:
    section = data.get("rlmesh")
    token = os.environ.get(ENV_AUTH_TOKEN)
    if token and isinstance(section, dict) and section.get("auth_token") is None:
        section["auth_token"] = token


def with_redis_password(url: str, password: str) -> str:
    """``url`` with ``password`` (%-encoded) in its user part, kept where ``url`` already has one."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or parts.password is not None or not parts.hostname:
        return url
    user = parts.username or ""
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def _apply_env_redis_password(data: dict[str, Any]) -> None:
    # As for the token: compose and `rlmesh redis` users hand the password over in the environment,
    # where a URL in argv would show it to every user of the machine.
    password = os.environ.get(ENV_REDIS_PASSWORD)
    section = data.get("rlmesh")
    if not password or not isinstance(section, dict):
        return
    url = section.get("redis_url")  # the defaults tree has it, given or not
    if isinstance(url, str):
        section["redis_url"] = with_redis_password(url, password)


ENV_TLS_CERT = "RLMESH_TLS_CERT_FILE"
ENV_TLS_KEY = "RLMESH_TLS_KEY_FILE"
ENV_TLS_CA = "RLMESH_TLS_CA_FILE"
ENV_TLS_VERIFY_CLIENTS = "RLMESH_TLS_VERIFY_CLIENTS"
_TLS_ENV = {"cert_file": ENV_TLS_CERT, "key_file": ENV_TLS_KEY, "ca_file": ENV_TLS_CA}


def _apply_env_tls(data: dict[str, Any]) -> None:
    # A service exports its TLS files there for its clients and children (runtime/tls.py).
    tls = data.get("rlmesh", {}).get("security", {}).get("tls")
    if not isinstance(tls, dict) or any(tls.get(k) for k in _TLS_ENV):
        return
    if all(os.environ.get(env) for env in _TLS_ENV.values()):
        tls.update({k: os.environ[env] for k, env in _TLS_ENV.items()})
        if not tls.get("verify_clients"):
            tls["verify_clients"] = os.environ.get(ENV_TLS_VERIFY_CLIENTS, "") in ("1", "true", "yes")


def config_from_dict(data: Mapping[str, Any]) -> RLMeshConfig:
    """Validate already-resolved plain data; raises ConfigError listing every problem."""
    try:
        cfg = RLMeshConfig.model_validate(dict(data))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    for note in cfg.config_warnings():
        warnings.warn(note, ConfigWarning, stacklevel=3)
    return cfg


def _read_layers(
    config_path: str | os.PathLike[str] | None, overrides: Sequence[str], problems: list[str]
) -> list[dict[str, Any]]:
    if isinstance(overrides, str):  # a lone string would be split into characters
        overrides = [overrides]
    layers = [] if config_path is None else [_read_file(config_path, problems)]
    try:
        overrides = [*overrides, *secret_overrides_from_env()]  # from a launcher: see secrets.py
    except ValueError as e:
        problems.append(str(e))
    for index, arg in enumerate(overrides, start=1):
        parsed = _parse_override(arg, index, problems)
        if parsed is not None:
            layers.append(parsed)
    for layer in layers:
        drop_legacy_nulls(layer)
    return layers


def given_keys(config_path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> set[str]:
    """The dotted keys the YAML file and the overrides write (sections and leaves), as opposed to
    those left at their defaults: ``rlmesh train`` starts a private Redis unless
    ``rlmesh.redis_url`` is among them."""
    return _paths(_read_layers(config_path, overrides, []))


def _paths(layers: Sequence[Mapping[str, Any]]) -> set[str]:
    keys: set[str] = set()

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            keys.add(path)
            if isinstance(value, Mapping):
                walk(value, f"{path}.")

    for layer in layers:
        walk(layer, "")
    return keys


def _ignored_values(cfg: RLMeshConfig) -> dict[str, Any]:
    """Every ignored (compat) leaf with the value it loaded with."""
    data = cfg.model_dump(mode="json")
    return {item.key: _leaf_of(data, item.key) for item in config_keys() if item.compat}


def ignored_keys(
    config_path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> list[tuple[str, Any, str]]:
    """``(key, value, why)`` for every key the file and overrides set that rlmesh ignores."""
    cfg = load_config(config_path, overrides, warn=False)
    return ignored_given(given_keys(config_path, overrides), _ignored_values(cfg))


def load_config(
    config_path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), *, warn: bool = True
) -> RLMeshConfig:
    """Defaults <- YAML file <- overrides, interpolations resolved, validated.

    Warns (ConfigWarning) about suspicious combinations, and once, listing them all, about the
    keys the file and overrides set that rlmesh ignores; ``warn=False``: silently.

    Raises ConfigError with every problem found (file, overrides, unknown keys, bad values,
    cross-field rules). `rlmesh.auth_token: null` takes env RLMESH_AUTH_TOKEN when that is set,
    a `rlmesh.redis_url` without a password env RLMESH_REDIS_PASSWORD's; env RLMESH_SECRET_OVERRIDES (a launcher's secrets for its child) adds overrides after the rest.
    """
    problems: list[str] = []
    layers = _read_layers(config_path, overrides, problems)
    tree = copy.deepcopy(_defaults_tree())
    for layer in layers:
        _deep_merge(tree, layer)
    data: dict[str, Any] = tree
    # OmegaConf resolution costs ~0.1 s on this tree; skip it when the user wrote no `${`/`???`.
    # (The one interpolation among the defaults, trainer.default_local_dir, RLMeshConfig resolves.)
    if any(_has_markers(layer) for layer in layers):
        try:
            data = _resolve(OmegaConf.create(tree), "", problems)
        except OmegaConfBaseException as e:  # e.g. a key OmegaConf cannot hold
            raise ConfigError([*problems, f"cannot build the config: {e}"]) from None
    _apply_env_token(data)
    _apply_env_redis_password(data)
    _apply_env_tls(data)
    given = _paths(layers)
    mapped = map_verl_keys(data, given, problems)
    _split_gpus(data, given, problems)
    try:
        with warnings.catch_warnings():
            if not warn:
                warnings.simplefilter("ignore", ConfigWarning)
            cfg = config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(problems + e.problems) from None
    if problems:
        raise ConfigError(problems)
    ignored = ignored_given(given, _ignored_values(cfg))
    if warn and mapped:
        warnings.warn(mapped_message(mapped), ConfigWarning, stacklevel=2)
    if warn and ignored:
        warnings.warn(ignored_message(ignored), ConfigWarning, stacklevel=2)
    return cfg


def _split_gpus(data: dict[str, Any], given: set[str], problems: list[str]) -> None:
    """verl's ``trainer.n_gpus_per_node``, when a config sets it (or ``trainer.nnodes``), split
    between the learner's ranks and the rollout replicas the config did not set itself
    (``placement.split_gpus``); a split that cannot fit is a problem naming the numbers. One GPU
    shared by the learner and its replica makes the weight sync gloo, as NCCL needs two GPUs."""
    if not given & {"trainer.n_gpus_per_node", "trainer.nnodes"}:
        return
    trainer = data.get("trainer") or {}
    gpus, nodes = trainer.get("n_gpus_per_node"), trainer.get("nnodes")
    if not (isinstance(gpus, int) and isinstance(nodes, int)) or gpus < 1:
        return  # a bad value is reported by validation; 0 GPUs: a CPU run keeps rlmesh.learner.ranks
    if nodes > 1:
        warnings.warn(
            f"trainer.nnodes={nodes}: `rlmesh train` and `rlmesh serve learner` start the learner's ranks on "
            f"one machine; train on {nodes} nodes under torchrun (README, 'GPU') with "
            "rlmesh.learner.ranks set to the ranks of one node",
            ConfigWarning,
            stacklevel=3,
        )
    rlmesh = data.setdefault("rlmesh", {})
    rollout = (data.get("actor_rollout_ref") or {}).get("rollout") or {}
    tp = rollout.get("tensor_model_parallel_size")
    reference_gpus = (rlmesh.get("placement") or {}).get("reference_gpus", 0)
    if not isinstance(tp, int) or tp < 1 or not isinstance(reference_gpus, int):
        return  # reported by validation
    ref = rlmesh.get("reference") or {}
    try:
        split = split_gpus(
            gpus,
            tp=tp,
            learner_on_gpu=trainer.get("device", "cuda") == "cuda",
            rollout_on_gpu=rollout.get("name") == "sglang",
            ranks=_get_int(rlmesh, "learner", "ranks") if "rlmesh.learner.ranks" in given else None,
            replicas=_get_int(rlmesh, "rollout", "replicas") if "rlmesh.rollout.replicas" in given else None,
            reference_gpus=reference_gpus
            if reference_on_gpu(bool(ref.get("colocated")), ref.get("addresses"), ref.get("device"))
            else 0,
        )
    except PlacementError as e:
        problems.append(str(e))
        return
    rlmesh.setdefault("learner", {})["ranks"] = split.ranks
    rlmesh.setdefault("rollout", {})["replicas"] = split.replicas
    if split.shared:
        weight_sync = rlmesh.setdefault("weight_sync", {})
        if weight_sync.get("backend", "auto") == "nccl":
            problems.append(
                f"rlmesh.weight_sync.backend=nccl with trainer.n_gpus_per_node={gpus}: the learner and "
                "the replica share the GPU and NCCL refuses two ranks of one group on one GPU; use gloo"
            )
        weight_sync["backend"] = "gloo"


def _get_int(tree: dict[str, Any], section: str, key: str) -> int | None:
    value = (tree.get(section) or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def dump_yaml(cfg: RLMeshConfig) -> str:
    """The full resolved config as YAML; load_config(that file) gives an equal config.

    It includes rlmesh.auth_token when one is set: treat the output as a secret then
    (:func:`dump_public_yaml` is the copy to show or store).
    """
    data = cfg.model_dump(mode="json")
    if cfg.rlmesh.auth_token is not None:
        # A YAML holds no secret type: the copy that loads back must carry the token itself.
        data["rlmesh"]["auth_token"] = cfg.rlmesh.token()
    return _yaml_of(data)


def dump_public_yaml(cfg: RLMeshConfig) -> str:
    """:func:`dump_yaml` of :func:`~rlmesh.config.secrets.public_config`: every secret ``***``, URL
    passwords masked. What the learner publishes, ``/api/v1/run/config`` shows and a checkpoint's
    ``config.yaml`` holds; it loads again (a masked token or password must then be given anew)."""
    return _yaml_of(public_config(cfg))


def _yaml_of(data: dict[str, Any]) -> str:
    # Ignored keys at their defaults are left out: a service that loads this file would otherwise
    # list every one of them as set-and-ignored.
    defaults = _defaults_tree()
    for item in config_keys():
        if item.compat and _leaf_of(data, item.key) == _leaf_of(defaults, item.key):
            parent, _, leaf = item.key.rpartition(".")
            del _leaf_of(data, parent)[leaf]
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _leaf_of(tree: Mapping[str, Any], key: str) -> Any:
    for part in key.split(".") if key else ():
        tree = tree[part]
    return tree
