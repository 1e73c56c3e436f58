"""Opt-in automatic responses (``rlmesh.control.auto``): the remedy an alert condition calls for
(KL high: raise the KL coefficient; grad norm high: lower the actor lr), bounded and rate-limited;
pure decisions, which the control plane applies. docs/control.md#automatic-responses"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rlmesh.config.rlmesh_section import AutoResponseConfig

KL_HIGH = "kl_high"
GRAD_NORM_HIGH = "grad_norm_high"
RULES = (KL_HIGH, GRAD_NORM_HIGH)
# A KL coefficient that is 0 cannot be raised by a factor: the first raise sets this (verl's
# default kl_loss_coef), bounded by the ceiling like any other.
KL_COEF_SEED = 0.001
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


@dataclass(frozen=True)
class Remedy:
    rule: str
    hparam: str  # a name of rlmesh.config.hparams.HPARAMS
    old: float
    new: float
    reason: str


def kl_reading(metrics: Mapping[str, float]) -> tuple[str, float] | None:
    """The KL mean a step reports and the coefficient that acts on it: with KL in the reward its
    penalty (``actor/reward_kl_penalty``, the controller's ``kl_coef``), else with a KL loss its
    value (``actor/kl_loss``, reported with ``actor/kl_coef``: ``kl_loss_coef``)."""
    if "actor/reward_kl_penalty" in metrics:
        return "kl_coef", float(metrics["actor/reward_kl_penalty"])
    if "actor/kl_coef" in metrics and "actor/kl_loss" in metrics:
        return "kl_loss_coef", float(metrics["actor/kl_loss"])
    return None


class AutoResponder:
    """Decides remedies; each rule acts at most once per ``min_steps_between`` steps and
    ``min_seconds_between`` seconds (both must have passed)."""

    def __init__(self, cfg: AutoResponseConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.last: dict[str, tuple[int, float]] = {}  # rule -> (step, clock) of its last action

    def ready(self, rule: str, step: int) -> bool:
        last = self.last.get(rule)
        if last is None:
            return True
        step0, t0 = last
        return (
            step - step0 >= self.cfg.min_steps_between and self.clock() - t0 >= self.cfg.min_seconds_between
        )

    def acted(self, rule: str, step: int) -> None:
        self.last[rule] = (step, self.clock())

    def kl_remedy(self, kl: float, coef_name: str, hparams: Mapping[str, float], why: str) -> Remedy | None:
        old = float(hparams.get(coef_name, 0.0))
        new = min(old * self.cfg.kl_factor if old > 0 else KL_COEF_SEED, self.cfg.kl_coef_max)
        if new <= old:
            return None  # at the ceiling already
        return Remedy(KL_HIGH, coef_name, old, new, why)

    def lr_remedy(self, hparams: Mapping[str, float], why: str) -> Remedy | None:
        old = float(hparams.get("actor_lr", 0.0))
        new = max(old * self.cfg.lr_factor, self.cfg.lr_min)
        if new >= old:
            return None  # at the floor already
        return Remedy(GRAD_NORM_HIGH, "actor_lr", old, new, why)

    def decide(self, step: int, metrics: Mapping[str, float], hparams: Mapping[str, float]) -> list[Remedy]:
        """The remedies step ``step``'s metrics call for now (``hparams``: the values in force, by
        the REST names). The caller applies them and then calls ``acted``."""
        out = []
        reading = kl_reading(metrics)
        if reading is not None and reading[1] > self.cfg.kl_threshold and self.ready(KL_HIGH, step):
            name, kl = reading
            remedy = self.kl_remedy(
                kl, name, hparams, f"step {step}: KL {kl:.4g} > {self.cfg.kl_threshold:g}"
            )
            if remedy is not None:
                out.append(remedy)
        grad = metrics.get("actor/grad_norm")
        if grad is not None and grad > self.cfg.grad_norm_threshold and self.ready(GRAD_NORM_HIGH, step):
            why = f"step {step}: actor grad norm {grad:.4g} > {self.cfg.grad_norm_threshold:g}"
            remedy = self.lr_remedy(hparams, why)
            if remedy is not None:
                out.append(remedy)
        return out

    def on_alert(
        self, alertname: str, step: int, metrics: Mapping[str, float], hparams: Mapping[str, float]
    ) -> Remedy | None:
        """The remedy a firing Alertmanager alert calls for (``rule_of_alert``), rate-limited like
        the metric rules; None for an alert no remedy answers."""
        rule = rule_of_alert(alertname)
        if rule is None or not self.ready(rule, step):
            return None
        why = f"alert {alertname} firing (step {step})"
        if rule == GRAD_NORM_HIGH:
            return self.lr_remedy(hparams, why)
        reading = kl_reading(metrics)
        return self.kl_remedy(
            reading[1] if reading else 0.0, reading[0] if reading else "kl_coef", hparams, why
        )


def rule_of_alert(alertname: str) -> str | None:
    """Which rule an alert name calls for, by its words (CamelCase, ``_`` or ``-`` separated): the
    word ``KL`` (RlmeshKLHigh, kl_mean_high) the KL remedy, ``GradNorm`` or ``grad norm`` the lr
    remedy; None for any other alert."""
    words = [w.lower() for w in _WORDS.findall(alertname)]
    joined = " ".join(words)
    if "gradnorm" in words or "grad norm" in joined:
        return GRAD_NORM_HIGH
    if "kl" in words and "coef" not in words:
        return KL_HIGH
    return None
