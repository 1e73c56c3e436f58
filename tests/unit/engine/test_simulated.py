"""The simulated engine model (rlmesh.engine.simulated) under the real continuous-batching engine:
responses end at eos at their drawn lengths, log-probs are those of its logits, the weights are real
tensors of the set size, and a bad spec is refused naming what is wrong."""

import json
import math
import threading

import pytest
import torch

from rlmesh.engine.batching import BatchEngine, GenerationRequest
from rlmesh.engine.runner import make_runner
from rlmesh.engine.sampling import SamplingParams
from rlmesh.engine.simulated import (
    SimulatedModel,
    SimulatedRunner,
    SimulationSpec,
    SimulationSpecError,
    read_simulation_spec,
    simulation_spec,
    write_simulated_model,
)
from rlmesh.engine.weight_updates import EngineWeights

# No pacing worth the name: these tests are about what is generated, not when.
FAST = {"tokens_per_s": 1e9, "vocab_size": 32, "eos_token_id": 3}


def run(engine: BatchEngine, prompts, params: SamplingParams) -> GenerationRequest:
    done = threading.Event()
    request = GenerationRequest(rid="r", prompts=prompts, params=params, on_done=lambda _: done.set())
    engine.submit(request)
    assert done.wait(60), "the simulated engine never finished the request"
    return request


@pytest.fixture
def engine_of():
    engines = []

    def make(**spec):
        model = SimulatedModel(SimulationSpec(**{**FAST, **spec}))
        engine = BatchEngine(model, eos_token_ids={model.spec.eos_token_id}, max_batch_size=16)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.stop()


def test_responses_end_at_eos_at_the_lengths_the_runner_draws(engine_of):
    spec = {"length_median": 20, "length_sigma": 0.8, "length_max": 60, "seed": 7}
    engine = engine_of(**spec)
    request = run(engine, [[5, 6], [7, 8, 9]], SamplingParams(max_new_tokens=1000, n=20))
    expected = SimulatedRunner(SimulatedModel(SimulationSpec(**{**FAST, **spec})))
    lengths = sorted(len(s.output_ids) for s in request.sequences)
    assert lengths == sorted(expected.draw_length() for _ in range(40))
    assert len(set(lengths)) > 5 and max(lengths) <= 60  # a spread, clipped at length_max
    for s in request.sequences:
        assert s.finish_reason == {"type": "stop", "matched": 3}
        assert s.output_ids[-1] == 3 and 3 not in s.output_ids[:-1]
        # Any of the 31 other tokens, uniformly, then eos for certain.
        assert s.logprobs[:-1] == pytest.approx([-math.log(31)] * (len(s.output_ids) - 1))
        assert s.logprobs[-1] == 0.0


def test_max_new_tokens_cuts_a_longer_response_and_ignore_eos_runs_to_it(engine_of):
    engine = engine_of(length_median=50, length_sigma=0.0)
    cut = run(engine, [[1]], SamplingParams(max_new_tokens=10))
    assert [len(s.output_ids) for s in cut.sequences] == [10]
    assert cut.sequences[0].finish_reason == {"type": "length", "length": 10}
    shorter = engine_of(length_median=4, length_sigma=0.0)
    out = run(shorter, [[1]], SamplingParams(max_new_tokens=12, ignore_eos=True)).sequences[0]
    assert len(out.output_ids) == 12 and out.output_ids[3] == 3  # eos sampled at 4, not a stop


def test_the_weights_are_real_tensors_of_the_set_size_that_updates_write_into():
    spec = SimulationSpec(**FAST, weight_bytes=10_000, tensor_bytes=4_096, weight_dtype="bfloat16")
    model = SimulatedModel(spec)
    assert [(n, p.numel()) for n, p in model.named_parameters()] == [("w0", 2048), ("w1", 2048), ("w2", 904)]
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == 10_000
    assert isinstance(make_runner(model), SimulatedRunner)
    weights = EngineWeights(model)  # packed in one buffer, as a real model's are
    names = ["w0", "w1", "w2"]
    shapes = [[2048], [2048], [904]]
    # A flattened bucket of all three lands straight in the packed bytes: the whole 10,000.
    assert weights.direct_span(names, ["bfloat16"] * 3, shapes, "flattened_bucket") == slice(0, 10_000)
    new = {
        n: torch.full((k,), float(i + 1), dtype=torch.bfloat16)
        for i, (n, (k,)) in enumerate(zip(names, shapes, strict=True))
    }
    weights.load(new, strict=True)
    assert weights.get("w1", 3) == [2.0, 2.0, 2.0] and weights.get("w2", 0) == [3.0] * 904
    assert torch.equal(model.w0, new["w0"])


def test_a_row_due_to_end_under_min_new_tokens_goes_on_instead_of_failing(engine_of):
    engine = engine_of(length_median=3, length_sigma=0.0)
    out = run(engine, [[1]], SamplingParams(max_new_tokens=8, min_new_tokens=6)).sequences[0]
    # Drawn length 3, eos masked while fewer than 6 tokens are out: 6 other tokens, then eos.
    assert out.finish_reason == {"type": "stop", "matched": 3} and len(out.output_ids) == 7
    assert 3 not in out.output_ids[:6]


def test_a_model_directory_round_trips_and_a_real_one_is_not_simulated(tmp_path):
    spec = SimulationSpec(tokens_per_s=20.0, length_median=100, weight_bytes=1 << 16)
    assert read_simulation_spec(write_simulated_model(tmp_path / "sim", spec)) == spec
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_simulation_spec(tmp_path / "real") is None
    assert read_simulation_spec(tmp_path / "missing") is None


def test_an_unknown_key_or_a_bad_value_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad"
    write_simulated_model(bad, SimulationSpec())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "tokens_per_second": 5}))
    with pytest.raises(
        SimulationSpecError, match=r"config.json: unknown simulated-engine keys \['tokens_per_second'\]"
    ):
        read_simulation_spec(bad)
    with pytest.raises(
        SimulationSpecError, match=r"--flag: simulated engine: need tokens_per_s float \(got str 'x'\)"
    ):
        simulation_spec({"tokens_per_s": "x"}, "--flag", SimulationSpec())
    with pytest.raises(SimulationSpecError, match=r"need weight_bytes int \(got float 1000000000.0\)"):
        simulation_spec({"weight_bytes": 1e9}, "--flag")
    with pytest.raises(SimulationSpecError, match=r"--flag: unknown simulated-engine keys \['bad'\]"):
        simulation_spec({"bad": 1}, "--flag")
    with pytest.raises(ValueError, match=r"tokens_per_s > 0"):
        SimulationSpec(tokens_per_s=0)
    with pytest.raises(ValueError, match=r"length_median <= length_max"):
        SimulationSpec(length_median=5000, length_max=4096)
    with pytest.raises(ValueError, match=r"weight_dtype a torch dtype \(got 'float13'\)"):
        SimulationSpec(weight_dtype="float13")
