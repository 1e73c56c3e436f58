"""Building blocks shared by every config section: the strict base model and small field helpers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

COMPAT_DESCRIPTION = "accepted for verl compatibility; no effect in rlmesh"


class ConfigWarning(UserWarning):
    """A config that loads but probably does not do what its author meant."""


class CrossFieldProblems(ValueError):
    """Raised by the root validator; carries every cross-field problem so all are reported at once."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class Section(BaseModel):
    """Base of every section: unknown keys fail, and verl's `_target_` markers are dropped."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_hydra_target(cls, data: Any) -> Any:
        # verl's YAML names a dataclass in `_target_` for hydra.instantiate; it means nothing here.
        if isinstance(data, dict) and "_target_" in data:
            data = {k: v for k, v in data.items() if k != "_target_"}
        return data


def compat(default: Any = None) -> Any:
    """A verl key that a verl config commonly carries but that rlmesh ignores."""
    if isinstance(default, (dict, list)):
        value = default
        return Field(
            default_factory=lambda: type(value)(value),
            description=COMPAT_DESCRIPTION,
            json_schema_extra={"compat": True},
        )
    return Field(default, description=COMPAT_DESCRIPTION, json_schema_extra={"compat": True})


_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def _normalize_dtype(value: Any) -> Any:
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.lower(), value.lower())
    return value


# verl writes dtypes both ways ("bf16" and "bfloat16"); both load, the long name is stored.
DType = Annotated[Literal["bfloat16", "float16", "float32"], BeforeValidator(_normalize_dtype)]

# verl's kl_penalty(): k1/k2/k3 are the estimators of http://joschu.net/blog/kl-approx.html;
# a trailing "+" keeps the value but takes the k2 gradient (straight-through). "full" is not
# implemented in verl either.
KLPenalty = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "low_var_kl+", "k3+"]

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# verl's trainer strategies are accepted so verl configs load; rlmesh always trains with DeepSpeed.
Strategy = Literal["fsdp", "fsdp2", "megatron", "deepspeed"]

STRATEGY_DESCRIPTION = (
    "verl's fsdp/fsdp2/megatron are accepted and all map to 'deepspeed': rlmesh trains under "
    "DeepSpeed ZeRO (see deepspeed_config)"
)


def strategy_field() -> Any:
    """A role's ``strategy``: checked against verl's names, otherwise ignored (always DeepSpeed)."""
    return Field("fsdp", description=STRATEGY_DESCRIPTION, json_schema_extra={"compat": True})
