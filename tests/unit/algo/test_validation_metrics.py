"""verl's validation metrics (``process_validation_metrics``): per data source, variable and prompt,
``mean@n``, ``std@n`` and the bootstrapped ``best@k``/``worst@k``, averaged over prompts."""

from __future__ import annotations

import numpy as np
import pytest

from rlmesh.algo.diagnostics import bootstrap_metric, process_validation_metrics


def verl_reference(data_sources, uids, infos, seed=42):
    """verl's definition, one prompt and one subset size at a time, with its bootstrap draws."""
    out: dict = {}
    for source in dict.fromkeys(data_sources):
        for var, values in infos.items():
            per_prompt: dict[str, list[float]] = {}
            for uid in dict.fromkeys(uids):
                vals = [
                    v for s, u, v in zip(data_sources, uids, values, strict=True) if (s, u) == (source, uid)
                ]
                if not vals:
                    continue
                n = len(vals)
                m = {f"mean@{n}": np.mean(vals)}
                if n > 1:
                    m[f"std@{n}"] = np.std(vals)
                    sizes = [2**i for i in range(1, 10) if 2**i < n] + [n]
                    for k in sizes:
                        (bm, bs), (wm, ws) = bootstrap_metric(vals, k, [np.max, np.min], seed=seed)
                        m |= {
                            f"best@{k}/mean": bm,
                            f"best@{k}/std": bs,
                            f"worst@{k}/mean": wm,
                            f"worst@{k}/std": ws,
                        }
                for name, value in m.items():
                    per_prompt.setdefault(name, []).append(value)
            out.setdefault(source, {})[var] = {name: float(np.mean(v)) for name, v in per_prompt.items()}
    return out


def test_bootstrap_draws_are_verls_and_leave_the_global_rng_alone():
    np.random.seed(7)
    before = np.random.get_state()[1].copy()
    (mean, std), (low, _) = bootstrap_metric(
        [0.0, 1.0, 0.0, 0.0], 2, [np.max, np.min], n_bootstrap=1000, seed=42
    )
    assert (np.random.get_state()[1] == before).all()
    # verl: np.random.seed(42); idx = np.random.choice(4, size=(1000, 2), replace=True)
    idx = np.random.RandomState(42).choice(4, size=(1000, 2), replace=True)
    best = (idx == 1).any(axis=1).astype(float)
    assert mean == pytest.approx(best.mean()) and std == pytest.approx(best.std())
    assert 0.4 < mean < 0.5 and 0.04 < low < 0.09  # P(one of 2 draws is the 1.0) = 7/16, both: 1/16


def test_one_sample_per_prompt_gives_the_mean_only():
    out = process_validation_metrics(["a", "a", "b"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5]})
    assert out == {"a": {"reward": {"mean@1": 0.5}}, "b": {"reward": {"mean@1": 0.5}}}


def test_several_samples_per_prompt_match_verls_definition():
    rng = np.random.RandomState(0)
    sources = ["a"] * 24 + ["b"] * 15
    uids = [i // 4 for i in range(24)] + [100 + i // 5 for i in range(15)]
    infos = {"reward": rng.rand(39).round(1).tolist(), "acc": rng.randint(0, 2, 39).astype(float).tolist()}
    out = process_validation_metrics(sources, uids, infos)
    expected = verl_reference(sources, uids, infos)
    assert out.keys() == expected.keys()
    for source in expected:
        for var in expected[source]:
            assert out[source][var] == pytest.approx(expected[source][var], rel=1e-12, abs=1e-12)
    assert set(out["b"]["acc"]) == {"mean@5", "std@5", *(f"{w}@{k}/{s}" for w in ("best", "worst") for k in (2, 4, 5) for s in ("mean", "std"))}  # fmt: skip
    assert (
        out["a"]["reward"]["best@4/mean"]
        >= out["a"]["reward"]["mean@4"]
        >= out["a"]["reward"]["worst@4/mean"]
    )


def test_a_sample_without_the_variable_is_left_out_of_it():
    nan = float("nan")
    out = process_validation_metrics(
        ["a"] * 4, [0, 0, 1, 1], {"reward": [1.0, 0.0, 1.0, 1.0], "x": [2.0, nan, nan, nan]}
    )
    assert out["a"]["x"] == {"mean@1": 2.0}  # one prompt, one sample with it
    assert out["a"]["reward"]["mean@2"] == 0.75


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="x: 1 values for 2"):
        process_validation_metrics(["a", "a"], [0, 1], {"x": [1.0]})
