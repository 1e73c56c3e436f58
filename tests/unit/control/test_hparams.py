"""The live hyper-parameter table: every field's range, and messages that name the field."""

import inspect
import math

import pytest

from rlmesh.config import load_config
from rlmesh.config.hparams import BY_KEY, HPARAMS, known_values, problems
from rlmesh.learner.trainer import PPOTrainer
from rlmesh.v1 import learner_pb2


def test_every_field_is_one_of_the_learners():
    # One name per knob: the REST names are UpdateHyperparamsRequest's fields, one to one, and the
    # trainer's update_hyperparams arguments; the learner answers by config key (the integration
    # tests check both ends agree).
    fields = {f.name for f in learner_pb2.UpdateHyperparamsRequest.DESCRIPTOR.fields}
    assert set(HPARAMS) == fields
    arguments = set(inspect.signature(PPOTrainer.update_hyperparams).parameters) - {"self"}
    assert arguments == set(HPARAMS) - {"top_p"}  # top_p only changes how prompts are sampled
    for h in HPARAMS.values():
        assert BY_KEY[h.key] is h
    assert known_values({"actor_lr": 1e-3, "kl_coef": 0.1, "lr": 1}) == {"actor_lr": 1e-3, "kl_coef": 0.1}


def test_every_config_key_exists_and_its_default_is_in_range():
    cfg = load_config(None, [])
    for h in HPARAMS.values():
        node = cfg
        for part in h.key.split("."):
            node = getattr(node, part)
        assert not problems({h.name: float(node)}), (h.key, node)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"actor_lr": 0.0}, "actor_lr: 0 is outside (0, 1]"),
        ({"actor_lr": 2.0}, "actor_lr: 2 is outside (0, 1]"),
        ({"kl_coef": -0.1}, "kl_coef: -0.1 is outside [0, 10]"),
        ({"top_p": 1.5}, "top_p: 1.5 is outside (0, 1]"),
        ({"temperature": math.nan}, "temperature: nan is not a finite number"),
        ({"clip_ratio": math.inf}, "clip_ratio: inf is not a finite number"),
        ({"entropy_coeff": "0.1"}, "entropy_coeff: expected a number"),
        ({"entropy_coeff": True}, "entropy_coeff: expected a number"),
        ({"lr": 0.1}, "lr: not a live hyper-parameter"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(values, expected):
    [message] = problems(values)
    assert message.startswith(expected), message


def test_values_at_the_closed_ends_are_accepted():
    assert (
        problems({"kl_coef": 0.0, "kl_loss_coef": 10.0, "top_p": 1.0, "actor_lr": 1.0, "entropy_coeff": 0})
        == []
    )
