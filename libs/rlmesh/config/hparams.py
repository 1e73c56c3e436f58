"""The live hyper-parameters an operator may change, their ranges and config keys: one table the
REST API, the CLI and the automatic responses all validate against. docs/control.md"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Hparam:
    # The REST field and the Learner proto's UpdateHyperparamsRequest field; the loop applies kl_coef,
    # temperature and top_p itself, the trainer takes the others as arguments of update_hyperparams.
    name: str
    key: str  # the config key it overrides
    low: float
    high: float
    low_open: bool  # True: must be > low; False: >= low
    what: str


HPARAMS: dict[str, Hparam] = {
    h.name: h
    for h in (
        Hparam("actor_lr", "actor_rollout_ref.actor.optim.lr", 0.0, 1.0, True, "the actor's peak lr"),
        Hparam("critic_lr", "critic.optim.lr", 0.0, 1.0, True, "the critic's peak lr"),
        Hparam(
            "kl_coef",
            "algorithm.kl_ctrl.kl_coef",
            0.0,
            10.0,
            False,
            "the in-reward KL controller's coefficient",
        ),
        Hparam(
            "kl_loss_coef",
            "actor_rollout_ref.actor.kl_loss_coef",
            0.0,
            10.0,
            False,
            "the KL loss coefficient",
        ),
        Hparam(
            "entropy_coeff",
            "actor_rollout_ref.actor.entropy_coeff",
            0.0,
            1.0,
            False,
            "the entropy bonus",
        ),
        Hparam(
            "clip_ratio",
            "actor_rollout_ref.actor.clip_ratio",
            0.0,
            1.0,
            True,
            "the PPO clip range (both sides)",
        ),
        Hparam(
            "temperature",
            "actor_rollout_ref.rollout.temperature",
            0.0,
            2.0,
            True,
            "the rollout sampling temperature",
        ),
        Hparam("top_p", "actor_rollout_ref.rollout.top_p", 0.0, 1.0, True, "the rollout top-p"),
    )
}
BY_KEY = {h.key: h for h in HPARAMS.values()}


def range_text(h: Hparam) -> str:
    return f"{'(' if h.low_open else '['}{h.low:g}, {h.high:g}]"


def in_range(h: Hparam, value: float) -> bool:
    """Whether ``value`` is within ``h``'s range (NaN is not): the REST API and the learner's
    ``UpdateHyperparams`` both check with it."""
    return h.low <= value <= h.high and not (h.low_open and value == h.low)


def problems(values: dict[str, object]) -> list[str]:
    """What is wrong with a requested change, one message per field, each naming it."""
    out = []
    for name, value in values.items():
        h = HPARAMS.get(name)
        if h is None:
            out.append(f"{name}: not a live hyper-parameter (known: {', '.join(HPARAMS)})")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            out.append(f"{name}: expected a number, got {value!r}")
        elif not math.isfinite(value):
            out.append(f"{name}: {value} is not a finite number")
        elif not in_range(h, value):
            out.append(f"{name}: {value:g} is outside {range_text(h)}")
    return out


def known_values(values: dict[str, float]) -> dict[str, float]:
    """The live hyper-parameters among ``values`` (a learner's status map), as floats."""
    return {k: float(v) for k, v in values.items() if k in HPARAMS}
