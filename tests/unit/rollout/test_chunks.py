"""Chunks of a generation put together: what a cut changes, what one chunk adds, what is refused."""

import pytest

from rlmesh.engine.client import TOKEN_VERSIONS, EngineError
from rlmesh.queue.partials import PartialSample, partial_problem
from rlmesh.rollout.chunks import (
    RESUMED_TOKENS,
    as_output,
    chunk_params,
    chunk_problem,
    extend,
    resumed_from,
)


def out(ids, kind="length", lps=None):
    lps = lps if lps is not None else [-0.5] * len(ids)
    return {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": kind},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=False)],
        },
    }


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"max_new_tokens": 8}, None),
        ({"max_new_tokens": 8, "repetition_penalty": 1.0, "stop": []}, None),
        ({"temperature": 1.0}, "no max_new_tokens"),
        ({"max_new_tokens": 8, "stop": ["\n"]}, "sampling_params.stop is set"),
        ({"max_new_tokens": 8, "frequency_penalty": 0.5}, "sampling_params.frequency_penalty is set"),
        ({"max_new_tokens": 8, "sampling_seed": 3}, "sampling_params.sampling_seed is set"),
    ],
)
def test_a_request_is_cut_only_where_the_cut_changes_nothing(params, problem):
    assert chunk_problem(params) == problem


def test_the_next_chunk_asks_for_what_is_left_of_the_limit_and_the_minimum():
    params = {"max_new_tokens": 10, "min_new_tokens": 7, "n": 4, "temperature": 0.7}
    sample = PartialSample(output_ids=[1, 2, 3, 4], log_probs=[-1.0] * 4, token_policy_versions=[0] * 4)
    assert chunk_params(params, sample, 3) == {
        "max_new_tokens": 3,
        "min_new_tokens": 3,
        "n": 1,
        "temperature": 0.7,
    }
    sample.output_ids.extend([5, 6, 7, 8])
    assert chunk_params(params, sample, 3) == {
        "max_new_tokens": 2,
        "min_new_tokens": 0,
        "n": 1,
        "temperature": 0.7,
    }


def test_chunks_add_up_and_the_sample_completes_at_a_stop_or_the_limit():
    sample = PartialSample()
    extend(sample, out([4, 5], lps=[-0.1, -0.2]), [3, 3], max_new_tokens=6)
    assert not sample.finish_reason  # the chunk's "length" is the chunk's, not the task's
    extend(sample, out([6, 7], lps=[-0.3, -0.4]), [4, 4], max_new_tokens=6)
    extend(sample, out([8, 9]), [4, 4], max_new_tokens=6)
    assert sample.finish_reason == "length"
    assert list(sample.output_ids) == [4, 5, 6, 7, 8, 9]
    assert list(sample.token_policy_versions) == [3, 3, 4, 4, 4, 4]
    stopped = PartialSample()
    extend(stopped, out([4, 2], kind="stop"), [0, 0], max_new_tokens=6)
    assert stopped.finish_reason == "stop"


def test_an_abort_keeps_its_tokens_as_resumed_and_the_sample_goes_on():
    sample = PartialSample()
    extend(sample, out([4, 5, 6], kind="abort"), [1, 1, 1], max_new_tokens=8)
    assert (list(sample.output_ids), sample.finish_reason, sample.resumed_tokens) == ([4, 5, 6], "", 3)
    extend(sample, out([7], kind="abort"), [2], max_new_tokens=4)
    assert sample.finish_reason == "length"


@pytest.mark.parametrize(
    ("output", "versions", "message"),
    [
        (out([4, 5], lps=[-0.1]), [0, 0], "2 tokens came with 1 log-probs and 2 versions"),
        (out([4, 5]), [0], "2 tokens came with 2 log-probs and 1 versions"),
        (out([4], kind="weird"), [0], "finished with 'weird'"),
    ],
)
def test_a_chunk_that_cannot_be_added_is_an_engine_error(output, versions, message):
    sample = PartialSample(output_ids=[1], log_probs=[-1.0], token_policy_versions=[0])
    with pytest.raises(EngineError, match=message):
        extend(sample, output, versions, max_new_tokens=8)
    assert list(sample.output_ids) == [1]  # nothing of it added


def test_a_sample_saved_by_this_process_keeps_its_own_resumed_count():
    saved = PartialSample(
        output_ids=[4, 5], log_probs=[-1.0, -1.0], token_policy_versions=[0, 0], resumed_tokens=1
    )
    assert resumed_from(saved, taken_over=False).resumed_tokens == 1
    assert resumed_from(saved, taken_over=True).resumed_tokens == 2


def test_a_complete_sample_reads_as_one_sglang_answer():
    saved = PartialSample(
        output_ids=[4, 5, 6],
        log_probs=[-0.5, -0.25, -0.125],
        token_policy_versions=[2, 3, 3],
        finish_reason="stop",
    )
    sample = resumed_from(saved)
    assert sample.resumed_tokens == 3 and resumed_from(None) == PartialSample()
    answer = as_output(sample)
    assert answer["output_ids"] == [4, 5, 6]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "stop"}
    assert meta["output_token_logprobs"] == [[-0.5, 4, None], [-0.25, 5, None], [-0.125, 6, None]]
    assert (meta[TOKEN_VERSIONS], meta[RESUMED_TOKENS], meta["weight_version"]) == ([2, 3, 3], 3, "3")


@pytest.mark.parametrize(
    ("sample", "problem"),
    [
        (PartialSample(output_ids=[1, 2], log_probs=[-1.0, -1.0], token_policy_versions=[0, 0]), None),
        (PartialSample(output_ids=[1, 2], log_probs=[-1.0], token_policy_versions=[0, 0]), "must be as many"),
        (
            PartialSample(output_ids=[1] * 9, log_probs=[-1.0] * 9, token_policy_versions=[0] * 9),
            "more than max",
        ),
        (PartialSample(output_ids=[1] * 8, log_probs=[-1.0] * 8, token_policy_versions=[0] * 8), "no finish"),
        (
            PartialSample(
                output_ids=[1] * 8,
                log_probs=[-1.0] * 8,
                token_policy_versions=[0] * 8,
                finish_reason="length",
            ),
            None,
        ),
        (PartialSample(output_ids=[1], log_probs=[float("nan")], token_policy_versions=[0]), "not finite"),
        (PartialSample(output_ids=[1], log_probs=[0.5], token_policy_versions=[0]), "above 0"),
        (PartialSample(output_ids=[-1], log_probs=[-1.0], token_policy_versions=[0]), "negative"),
        (PartialSample(output_ids=[1], log_probs=[-1.0], token_policy_versions=[-2]), "negative"),
        (PartialSample(finish_reason="abort"), "finish_reason 'abort'"),
        (
            PartialSample(output_ids=[1], log_probs=[-1.0], token_policy_versions=[0], resumed_tokens=2),
            "outside",
        ),
    ],
)
def test_a_saved_sample_is_checked_before_generation_goes_on_from_it(sample, problem):
    found = partial_problem(sample, max_new_tokens=8)
    assert (found is None) if problem is None else (problem in found)
