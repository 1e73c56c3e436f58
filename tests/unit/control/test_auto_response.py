"""The automatic responses' decisions: thresholds, bounded steps (factor, floor, ceiling), the
rate limit per rule, and which alerts call for which remedy."""

import pytest

from rlmesh.config.rlmesh_section import AutoResponseConfig
from rlmesh.control.auto_response import GRAD_NORM_HIGH, KL_HIGH, AutoResponder, kl_reading, rule_of_alert

HPARAMS = {"kl_coef": 0.1, "kl_loss_coef": 0.001, "actor_lr": 1e-4}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def responder(**settings):
    clock = Clock()
    cfg = AutoResponseConfig(enabled=True, min_steps_between=3, min_seconds_between=60, **settings)
    return AutoResponder(cfg, clock=clock), clock


def test_nothing_happens_below_the_thresholds():
    auto, _ = responder()
    assert auto.decide(1, {"actor/reward_kl_penalty": 0.03, "actor/grad_norm": 5.0}, HPARAMS) == []


def test_high_kl_raises_the_coefficient_that_acts_on_it():
    auto, _ = responder()
    [remedy] = auto.decide(4, {"actor/reward_kl_penalty": 0.05}, HPARAMS)
    assert (remedy.rule, remedy.hparam, remedy.old, remedy.new) == (
        KL_HIGH,
        "kl_coef",
        0.1,
        pytest.approx(0.15),
    )
    assert "KL 0.05 > 0.03" in remedy.reason
    # With a KL loss (actor/kl_coef reported) instead of KL in the reward: the loss's coefficient.
    [remedy] = auto.decide(4, {"actor/kl_loss": 0.2, "actor/kl_coef": 0.001}, HPARAMS)
    assert remedy.hparam == "kl_loss_coef" and remedy.new == pytest.approx(0.0015)
    assert kl_reading({"actor/kl_loss": 0.2}) is None  # reported as 0 without a KL loss: no reading


def test_high_grad_norm_lowers_the_actor_lr():
    auto, _ = responder()
    [remedy] = auto.decide(2, {"actor/grad_norm": 7.5}, HPARAMS)
    assert (remedy.rule, remedy.hparam, remedy.new) == (GRAD_NORM_HIGH, "actor_lr", pytest.approx(5e-5))


def test_remedies_stop_at_the_ceiling_and_the_floor():
    auto, _ = responder(kl_coef_max=0.12, lr_min=8e-5)
    [kl, lr] = auto.decide(1, {"actor/reward_kl_penalty": 1.0, "actor/grad_norm": 50}, HPARAMS)
    assert kl.new == 0.12 and lr.new == 8e-5  # bounded, not the factor's value
    at_bounds = {"kl_coef": 0.12, "actor_lr": 8e-5}
    assert auto.decide(1, {"actor/reward_kl_penalty": 1.0, "actor/grad_norm": 50}, at_bounds) == []
    # A coefficient of 0 cannot grow by a factor: the first raise seeds it.
    [seeded] = auto.decide(1, {"actor/reward_kl_penalty": 1.0}, {"kl_coef": 0.0})
    assert seeded.new == 0.001


def test_each_rule_acts_at_most_once_per_steps_and_seconds():
    auto, clock = responder()
    high = {"actor/reward_kl_penalty": 0.5, "actor/grad_norm": 50}
    assert {r.rule for r in auto.decide(10, high, HPARAMS)} == {KL_HIGH, GRAD_NORM_HIGH}
    auto.acted(KL_HIGH, 10)
    assert [r.rule for r in auto.decide(11, high, HPARAMS)] == [GRAD_NORM_HIGH]  # the other rule is free
    clock.now = 1000.0
    assert [r.rule for r in auto.decide(12, high, HPARAMS)] == [GRAD_NORM_HIGH]  # 2 steps < 3
    clock.now = 0.0 + 59.0
    assert [r.rule for r in auto.decide(13, high, HPARAMS)] == [GRAD_NORM_HIGH]  # 3 steps, 59 s < 60
    clock.now = 60.0
    assert {r.rule for r in auto.decide(13, high, HPARAMS)} == {KL_HIGH, GRAD_NORM_HIGH}


@pytest.mark.parametrize(
    ("alert", "rule"),
    [
        ("RLMeshKLHigh", KL_HIGH),  # deploy/alerts.yml's names
        ("RLMeshGradNormHigh", GRAD_NORM_HIGH),
        ("RLMeshQueueBacklogGrowing", None),
        ("RlmeshKLHigh", KL_HIGH),
        ("kl_mean_high", KL_HIGH),
        ("ActorGradNormHigh", GRAD_NORM_HIGH),
        ("actor_grad_norm_high", GRAD_NORM_HIGH),
        ("TrajectoryQueueBacklog", None),  # "backlog" holds the letters k, l: not the word KL
        ("RlmeshKLCoefHigh", None),
        ("ServiceDown", None),
    ],
)
def test_alert_names_map_to_rules_by_their_words(alert, rule):
    assert rule_of_alert(alert) == rule


def test_an_alert_acts_through_the_same_bounds_and_rate_limit():
    auto, _ = responder()
    remedy = auto.on_alert("RlmeshKLHigh", 5, {"actor/reward_kl_penalty": 0.04}, HPARAMS)
    assert remedy is not None and remedy.hparam == "kl_coef" and "alert RlmeshKLHigh" in remedy.reason
    auto.acted(remedy.rule, 5)
    assert auto.on_alert("RlmeshKLHigh", 6, {}, HPARAMS) is None
    assert auto.on_alert("ServiceDown", 6, {}, HPARAMS) is None
