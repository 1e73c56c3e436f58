"""A step's independent phases side by side (rlmesh.learner.overlap_phases, one rank): the critic's
update beside the actor's, the forwards beside each other, with the same result as in order."""

from __future__ import annotations

import threading

import pytest
import torch

from rlmesh.learner import PPOTrainer, build_batch
from tests.support.learner import PAD, TIMING_PREFIXES, make_config, make_trajectories, module_state


def test_overlapped_updates_equal_the_in_order_ones(tiny_model_dir):
    # GAE (critic) + KL in the reward + an entropy bonus; 2 steps. One torch thread in both modes
    # (tests run with OMP_NUM_THREADS=1), so each model's arithmetic is the same, bit for bit.
    overrides = ("algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.entropy_coeff=0.01")
    assert torch.get_num_threads() == 1
    results = {}
    for overlap in (False, True):
        cfg = make_config(
            tiny_model_dir, *overrides, f"rlmesh.learner.overlap_phases={overlap}", estimator="gae"
        )
        trainer = PPOTrainer(cfg, total_training_steps=10)
        assert trainer.phases.overlap is overlap
        threads: dict[str, str] = {}
        for name, obj, method in (
            ("critic", trainer.critic, "update_critic"),
            ("actor", trainer.actor, "update_policy"),
        ):
            original = getattr(obj, method)

            def traced(*a, _original=original, _name=name, _threads=threads, **kw):
                _threads[_name] = threading.current_thread().name
                return _original(*a, **kw)

            setattr(obj, method, traced)
        metrics = []
        for seed in (31, 32):
            m = trainer.train_step(build_batch(make_trajectories(seed=seed), PAD))
            metrics.append({k: v for k, v in m.items() if not k.startswith(TIMING_PREFIXES)})
            assert {"timing_s/update_actor", "timing_s/update_critic", "timing_s/values"} <= m.keys()
        results[overlap] = (metrics, module_state(trainer.actor.engine), module_state(trainer.critic.engine))
        if overlap:
            assert threads["actor"] != threads["critic"]
            assert threads["actor"].startswith("learner-phase") and threads["critic"].startswith(
                "learner-phase"
            )
        else:
            assert threads["actor"] == threads["critic"] == threading.current_thread().name
    (m_seq, actor_seq, critic_seq), (m_par, actor_par, critic_par) = results[False], results[True]
    assert m_seq == m_par
    for want, got in ((actor_seq, actor_par), (critic_seq, critic_par)):
        assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_failing_update_fails_the_step(tiny_model_dir):
    trainer = PPOTrainer(make_config(tiny_model_dir, estimator="gae"), total_training_steps=10)

    def broken(*_a, **_kw):
        raise RuntimeError("critic exploded")

    trainer.critic.update_critic = broken
    with pytest.raises(RuntimeError, match="critic exploded"):
        trainer.train_step(build_batch(make_trajectories(seed=33), PAD))
