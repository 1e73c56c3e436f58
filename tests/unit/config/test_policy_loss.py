"""actor_rollout_ref.actor.policy_loss: every loss mode of verl's registry loads with its knobs and
hands them to its loss function; unknown modes, verl's internal bypass_mode and a mode without
the value it needs fail at load with a message saying what to do."""

from __future__ import annotations

import warnings

import pytest

from rlmesh.algo import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from rlmesh.config import ConfigError, ConfigWarning, load_config
from rlmesh.learner.ppo.actor import policy_loss_kwargs

PL = "actor_rollout_ref.actor.policy_loss"
ACTOR = "actor_rollout_ref.actor"
CLIP = [f"{ACTOR}.clip_ratio=0.3", f"{ACTOR}.clip_ratio_low=0.1", f"{ACTOR}.clip_ratio_high=0.28"]
CLIP_KWARGS = {"cliprange": 0.3, "cliprange_low": 0.1, "cliprange_high": 0.28}

# mode -> (overrides a verl command line would carry, the keyword arguments the loss gets)
MODES = {
    "vanilla": ([*CLIP, f"{ACTOR}.clip_ratio_c=4.0"], {**CLIP_KWARGS, "clip_ratio_c": 4.0}),
    "gspo": (CLIP, CLIP_KWARGS),
    "cispo": (CLIP, CLIP_KWARGS),
    "geo_mean": (CLIP, CLIP_KWARGS),
    "dppo_tv": ([*CLIP, f"{ACTOR}.clip_ratio_c=20.0"], {**CLIP_KWARGS, "clip_ratio_c": 20.0}),
    "dppo_kl": ([*CLIP, f"{ACTOR}.clip_ratio_c=20.0"], {**CLIP_KWARGS, "clip_ratio_c": 20.0}),
    "gpg": ([], {}),
    "sapo": ([f"{ACTOR}.tau_pos=1.5", f"{ACTOR}.tau_neg=2.5"], {"tau_pos": 1.5, "tau_neg": 2.5}),
    "clip_cov": (
        [*CLIP, f"{PL}.clip_cov_ratio=0.001", f"{PL}.clip_cov_lb=2.0", f"{PL}.clip_cov_ub=6.0"],
        {**CLIP_KWARGS, "clip_cov_ratio": 0.001, "clip_cov_lb": 2.0, "clip_cov_ub": 6.0, "generator": None},
    ),
    "kl_cov": (
        [f"{PL}.kl_cov_ratio=0.002", f"{PL}.ppo_kl_coef=1"],
        {"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0},
    ),
    "dro": ([f"{PL}.dro_beta=0.05"], {"dro_beta": 0.05}),
}


def test_the_config_takes_every_registered_loss():
    assert set(MODES) == set(POLICY_LOSS_REGISTRY)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_loads_with_its_knobs_and_they_reach_the_loss(mode):
    overrides, kwargs = MODES[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # none of these keys is ignored any more
        cfg = load_config(None, [f"{PL}.loss_mode={mode}", *overrides])
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == mode
    assert policy_loss_kwargs(actor) == kwargs
    get_policy_loss_fn(mode)  # registered under the config's name


def test_knob_defaults_are_verls():
    # verl 0.9.1 actor/actor.yaml (and the PolicyLossConfig / ActorConfig dataclasses)
    actor = load_config(None, []).actor_rollout_ref.actor
    loss = actor.policy_loss
    assert (loss.loss_mode, loss.clip_cov_ratio, loss.clip_cov_lb, loss.clip_cov_ub) == (
        "vanilla",
        0.0002,
        1.0,
        5.0,
    )
    assert (loss.kl_cov_ratio, loss.ppo_kl_coef, loss.dro_beta) == (0.0002, 0.1, None)
    assert (actor.tau_pos, actor.tau_neg) == (1.0, 1.05)


def test_the_knobs_of_another_mode_are_accepted_unused():
    # A verl line setting clip_cov's knobs while training vanilla loads, as in verl.
    cfg = load_config(None, [f"{PL}.clip_cov_ratio=0", f"{PL}.kl_cov_ratio=0", f"{PL}.dro_beta=-1"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"


def problem(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


def test_unknown_mode_is_refused_listing_the_modes():
    message = problem([f"{PL}.loss_mode=reinforce"])
    assert message.startswith(f"bad value for '{PL}.loss_mode': 'reinforce'; allowed: 'vanilla', ")
    for mode in MODES:
        assert f"'{mode}'" in message


def test_bypass_mode_points_at_the_rollout_correction_key():
    message = problem([f"{PL}.loss_mode=bypass_mode"])
    assert message.startswith(f"bad value for '{PL}.loss_mode': 'bypass_mode'; ")
    assert "algorithm.rollout_correction.bypass_mode=true" in message


@pytest.mark.parametrize(
    ("overrides", "needs"),
    [
        ([f"{PL}.loss_mode=dro"], "loss_mode dro needs dro_beta > 0 (got None)"),
        ([f"{PL}.loss_mode=dro", f"{PL}.dro_beta=0"], "loss_mode dro needs dro_beta > 0 (got 0.0)"),
        (
            [f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0"],
            "loss_mode clip_cov needs clip_cov_ratio > 0",
        ),
        ([f"{PL}.loss_mode=kl_cov", f"{PL}.kl_cov_ratio=-1"], "loss_mode kl_cov needs kl_cov_ratio > 0"),
    ],
)
def test_a_mode_without_the_value_it_needs_is_refused(overrides, needs):
    message = problem(overrides)
    assert message.startswith(f"'{PL}': {needs}"), message


def test_sapo_temperatures_must_be_positive():
    assert problem([f"{ACTOR}.tau_pos=0"]).startswith(f"bad value for '{ACTOR}.tau_pos': 0; must be > 0")
