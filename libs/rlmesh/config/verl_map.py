"""verl's other spellings, applied before validation: renamed or moved keys onto rlmesh's, verl's
engines onto rlmesh's, and keys that would change the result if ignored refused unless at their
default; each mapping is named in one warning (docs/config.md#keys-rlmesh-maps)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_KEY = "actor_rollout_ref.rollout.name"
# verl's engines: rlmesh has neither vLLM nor TensorRT-LLM; SGLang takes the same rollout knobs.
VERL_ENGINES = ("vllm", "trtllm", "hf")
REQUIRED = "???"
LEGACY_SECTIONS = ("reward_model", "custom_reward_function")

# (verl key, rlmesh key): the same setting under verl's other name; a subtree moves whole.
MOVED: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", "rlmesh.weight_sync.bucket_size_mb"),
    # verl >= 0.8 moves reward_model / custom_reward_function under one `reward` section
    ("reward.custom_reward_function.path", "custom_reward_function.path"),
    ("reward.custom_reward_function.name", "custom_reward_function.name"),
    ("reward.custom_reward_function.reward_kwargs", "custom_reward_function.reward_kwargs"),
    ("reward.reward_manager.name", "reward_model.reward_manager"),
    ("reward_manager.name", "reward_model.reward_manager"),  # verl 0.7's top-level section
    ("reward.reward_kwargs", "reward_model.reward_kwargs"),
    ("reward.reward_model.enable", "reward_model.enable"),
    ("reward.reward_model.model_path", "reward_model.model.path"),
    ("reward.num_workers", "reward_model.num_workers"),
    ("reward.sandbox_fusion", "reward_model.sandbox_fusion"),
    ("sandbox_fusion", "reward_model.sandbox_fusion"),
    # verl >= 0.8's critic engine section; rlmesh reads the offload flags from critic.model.fsdp_config
    ("critic.fsdp.param_offload", "critic.model.fsdp_config.param_offload"),
    ("critic.fsdp.optimizer_offload", "critic.model.fsdp_config.optimizer_offload"),
)

# Keys whose being ignored would change what a run computes: refused unless at their default.
# (dotted key, is the value acceptable, what to do instead)
NONE_OR_EMPTY: Callable[[Any], bool] = lambda v: v in (None, "", {}, [])  # noqa: E731
FALSE: Callable[[Any], bool] = lambda v: v in (None, False)  # noqa: E731
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "reward_model.sandbox_fusion.url",
        NONE_OR_EMPTY,
        "code-execution rewards are not built in: call your sandbox from a custom_reward_function",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.enable",
        FALSE,
        "multi-turn tool-use rollouts are not implemented: a replica generates one turn",
    ),
    ("data.tool_config_path", NONE_OR_EMPTY, "multi-turn tool use is not implemented"),
    ("data.function_tool_path", NONE_OR_EMPTY, "multi-turn tool use is not implemented"),
    (
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        lambda v: v in (None, "single_turn_agent"),
        "agent loops are not implemented: a replica generates one turn",
    ),
    (
        "actor_rollout_ref.rollout.agent.agent_loop_config_path",
        NONE_OR_EMPTY,
        "agent loops are not implemented: a replica generates one turn",
    ),
    (
        "actor_rollout_ref.rollout.agent.custom_async_server.path",
        NONE_OR_EMPTY,
        "replicas run SGLang or the embedded engine; a custom server attaches through rollout.sglang.url",
    ),
    (
        "data.custom_cls.path",
        NONE_OR_EMPTY,
        "datasets are verl's Parquet layout (prompt, data_source, reward_model.ground_truth); convert "
        "yours with `rlmesh data` or write the Parquet file",
    ),
    (
        "actor_rollout_ref.ref.model",
        NONE_OR_EMPTY,
        "the reference policy is actor_rollout_ref.model.path; a different reference model is not supported",
    ),
    (
        "algorithm.rollout_correction.rollout_rs_threshold",
        NONE_OR_EMPTY,
        "rejection sampling is not implemented; use rollout_is (truncated importance weights)",
    ),
    (
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
        NONE_OR_EMPTY,
        "rejection sampling is not implemented; use rollout_is (truncated importance weights)",
    ),
    (
        "algorithm.rollout_correction.rollout_token_veto_threshold",
        NONE_OR_EMPTY,
        "the token veto is not implemented; use rollout_is with rollout_is_threshold",
    ),
    (
        "algorithm.rollout_correction.use_policy_gradient",
        FALSE,
        "the policy loss is policy_loss.loss_mode's (set loss_mode=gpg for a plain policy gradient)",
    ),
    ("distillation.enabled", FALSE, "on-policy distillation is not implemented"),
    *(
        (f"{section}.qat.enable", FALSE, "quantisation-aware training is not implemented")
        for section in (
            "actor_rollout_ref.actor",
            "actor_rollout_ref.actor.fsdp_config",
            "actor_rollout_ref.ref.fsdp_config",
            "critic.fsdp",
        )
    ),
    (
        "critic.model.lora_adapter_path",
        NONE_OR_EMPTY,
        "the critic starts from critic.model.path (fresh LoRA adapters when critic.model.lora_rank > 0)",
    ),
    (
        "actor_rollout_ref.rollout.disaggregation.enabled",
        FALSE,
        "prefill/decode disaggregation: start SGLang with it yourself and attach with rollout.sglang.url",
    ),
    ("skip.rollout.enable", FALSE, "skipping rollouts (replaying dumped ones) is not implemented"),
    ("skip.rollout_tq.enable", FALSE, "skipping rollouts (replaying dumped ones) is not implemented"),
    ("skip.async_rollout.enable", FALSE, "skipping rollouts (replaying dumped ones) is not implemented"),
    ("actor_rollout_ref.rollout.skip_rollout", FALSE, "skipping rollouts is not implemented"),
    *(
        (
            f"{model}.lora.{key}",
            allowed,
            f"{model}.lora is Megatron's LoRA (its module names are Megatron's): set {model}.{ours}",
        )
        for model in ("actor_rollout_ref.model", "critic.model")
        for key, ours, allowed in (
            ("rank", "lora_rank", lambda v: v in (None, 0)),
            ("adapter_path", "lora_adapter_path", NONE_OR_EMPTY),
        )
    ),
    (
        "trainer.v1.trainer_mode",
        lambda v: v in (None, "sync"),
        "verl's async trainer modes are rlmesh's own: set rlmesh.max_staleness (how far generation runs ahead)",
    ),
)


@dataclass(frozen=True)
class KeyMapping:
    """One mapping made: ``key=value`` read as ``target`` (``why`` says what it means)."""

    key: str
    value: Any
    target: str
    why: str = ""

    def line(self) -> str:
        shown = self.value if isinstance(self.value, str) else json.dumps(self.value)
        return f"  {self.key}={shown} -> {self.target}" + (f" ({self.why})" if self.why else "")


def gpu_present() -> bool:
    """A CUDA GPU this process may use: the NVIDIA driver lists one and CUDA_VISIBLE_DEVICES does
    not hide them all (read without importing torch: config loading stays fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


def _has(tree: Mapping[str, Any], key: str) -> bool:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _get(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node[part]
    return node


def _pop(tree: dict[str, Any], key: str) -> Any:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node[part]
    value = node.pop(leaf)
    # a section left empty by the move (verl's `reward:` with only `_target_` left, say) goes too
    if parents and not {k for k in node if k != "_target_"}:
        _pop(tree, ".".join(parents))
    return value


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
        node[leaf].update(value)
    else:
        node[leaf] = value


def _set_here(value: Any) -> bool:
    """verl >= 0.8 fills its legacy sections with nulls: a null (or a subtree of nulls) sets nothing."""
    if isinstance(value, Mapping):
        return any(_set_here(v) for k, v in value.items() if k != "_target_")
    return value is not None


def drop_legacy_nulls(layer: dict[str, Any]) -> None:
    """verl >= 0.8 writes its legacy sections (reward_model, custom_reward_function) as nulls that
    mean "see the new `reward` section": a null there sets nothing (``layer``: one user layer)."""

    def prune(node: dict[str, Any]) -> None:
        for key in list(node):
            if isinstance(node[key], dict):
                prune(node[key])
            elif node[key] is None:
                del node[key]

    for section in LEGACY_SECTIONS:
        if isinstance(layer.get(section), dict) and isinstance(layer.get("reward"), dict):
            prune(layer[section])


def map_verl_keys(data: dict[str, Any], given: set[str], problems: list[str]) -> list[KeyMapping]:
    """Rewrite ``data`` (the merged tree, before validation) in place: every MOVED key onto the key
    rlmesh reads, the engine name onto rlmesh's engines. ``given``: the dotted keys the user wrote.
    Appends to ``problems`` a conflict (both spellings, different values) and each REFUSED key set
    to a value rlmesh cannot honour. Returns the mappings made."""
    made: list[KeyMapping] = []
    for src, dst in MOVED:
        if not _has(data, src):
            continue
        value = _pop(data, src)
        if not _set_here(value):
            continue
        if dst in given and _has(data, dst) and _get(data, dst) not in (None, value):
            problems.append(
                f"'{src}' and '{dst}' are the same setting (verl's and rlmesh's names) and are set to "
                f"different values ({value!r} and {_get(data, dst)!r}): set one"
            )
            continue
        _put(data, dst, value)
        given.add(dst)
        made.append(KeyMapping(src, value, dst))
    engine = _map_engine(data, given)
    if engine is not None:
        made.append(engine)
    for other in ("vllm", "trtllm"):
        key = f"actor_rollout_ref.rollout.engine_kwargs.{other}"
        if _has(data, key) and _set_here(_get(data, key)):
            value = _pop(data, key)
            made.append(
                KeyMapping(
                    key, value, "nothing", f"{other}'s own arguments; SGLang's go in engine_kwargs.sglang"
                )
            )
    for key, allowed, instead in REFUSED:
        if _has(data, key) and not allowed(value := _get(data, key)):
            problems.append(f"'{key}'={value!r} is not supported by rlmesh: {instead}")
    _check_gen_batch_size(data, problems)
    return made


def _check_gen_batch_size(data: dict[str, Any], problems: list[str]) -> None:
    # verl's trainer draws data.gen_batch_size prompts a step when it is set; with dynamic sampling
    # rlmesh draws by need, without it the step would silently be smaller or larger than verl's.
    gen = _get(data, "data.gen_batch_size") if _has(data, "data.gen_batch_size") else None
    train = _get(data, "data.train_batch_size") if _has(data, "data.train_batch_size") else None
    filtering = _has(data, "algorithm.filter_groups.enable") and _get(data, "algorithm.filter_groups.enable")
    if gen is not None and gen != train and not filtering:
        problems.append(
            f"'data.gen_batch_size'={gen!r} without algorithm.filter_groups.enable: verl then trains "
            f"{gen} prompts a step; set data.train_batch_size={gen} (or enable filter_groups, where rlmesh "
            "draws refills as needed)"
        )


def _map_engine(data: dict[str, Any], given: set[str]) -> KeyMapping | None:
    rollout = data.setdefault("actor_rollout_ref", {}).setdefault("rollout", {})
    name = rollout.get("name")
    unset = ENGINE_KEY not in given or name in (None, REQUIRED)
    if not unset and name not in VERL_ENGINES:
        return None  # embedded, sglang, or a typo the validator names
    gpu = gpu_present()
    engine = "sglang" if gpu and name != "hf" else "embedded"
    rollout["name"] = engine
    if unset and not gpu:
        return None  # the CPU default, as always
    where = "this machine has a CUDA GPU" if gpu else "this machine has no CUDA GPU: the CPU engine"
    if unset:
        return KeyMapping(ENGINE_KEY, "(not set)", engine, f"{where}; verl's default engine was vLLM")
    why = {
        "hf": "HF transformers generation: the embedded engine",
        "vllm": f"rlmesh has no vLLM engine; {where}, with the same rollout knobs",
        "trtllm": f"rlmesh has no TensorRT-LLM engine; {where}, with the same rollout knobs",
    }[name]
    return KeyMapping(ENGINE_KEY, name, engine, why)


def mapped_message(made: list[KeyMapping]) -> str:
    """The one start-up warning naming every mapping made."""
    return "\n".join(
        [f"{len(made)} verl key(s) set here are mapped onto rlmesh's:", *(m.line() for m in made)]
    )
