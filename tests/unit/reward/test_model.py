"""Model-based reward: a tiny sequence-classification model, batched scores equal one-by-one ones."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from rlmesh.config import load_config
from rlmesh.models import build_tokenizer
from rlmesh.models.tokenizer import save_tokenizer
from rlmesh.reward.function_loader import RewardFunctionLoadError
from rlmesh.reward.model import RewardModelScorer
from rlmesh.reward.scorer import RewardScorer
from rlmesh.v1 import common_pb2, reward_pb2


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(str(out))
    save_tokenizer(tok, out)
    return out


def test_batched_scores_equal_one_by_one(rm_dir):
    rm = RewardModelScorer(str(rm_dir), micro_batch_size=2)
    prompts = ["What is 1+1?", "What is 12*3? Answer after ####.", "Hi"]
    responses = ["#### 2", "Let me see: #### 36", "a much longer response " * 3]
    batched = rm.score(prompts, responses)
    alone = [rm.score([p], [r])[0] for p, r in zip(prompts, responses, strict=True)]
    assert len(batched) == 3 and all(math.isfinite(s) for s in batched)
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(batched)) == 3
    assert "<|im_start|>assistant" in rm.format("p", "r")  # the chat template frames the pair


async def test_reward_scorer_with_the_model_from_config(rm_dir):
    cfg = load_config(None, ["reward_model.enable=true", f"reward_model.model.path={rm_dir}"])
    scorer = RewardScorer.from_config(cfg, load_tokenizer=False)
    batch = [
        reward_pb2.RewardSample(uid="a", prompt_text="What is 1+1?", response_text="#### 2"),
        reward_pb2.RewardSample(uid="b", prompt_text="Hi", response_text="hello"),
    ]
    results = await scorer.score(batch)
    expected = scorer.model.score(["What is 1+1?", "Hi"], ["#### 2", "hello"])
    assert [r.uid for r in results] == ["a", "b"]
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-6)
    assert scorer.functions()[0].startswith("*=reward_model:")

    def broken(prompts, responses):
        raise RuntimeError("CUDA out of memory (simulated)")

    scorer.model.score = broken
    results = await scorer.score(batch)
    assert all(r.error.code == common_pb2.ERROR_CODE_FUNCTION_FAILED for r in results)
    assert "CUDA out of memory" in results[0].error.message
    scorer.model.score = lambda p, r: [float("nan"), 1.0]
    nan, fine = await scorer.score(batch)
    assert nan.error.code == common_pb2.ERROR_CODE_NON_FINITE and fine.score == 1.0
    scorer.close()


def test_a_missing_reward_model_is_a_load_error(tmp_path):
    cfg = load_config(None, ["reward_model.enable=true", f"reward_model.model.path={tmp_path / 'none'}"])
    with pytest.raises(RewardFunctionLoadError, match=r"reward_model\.model\.path=.*no such directory"):
        RewardScorer.from_config(cfg, load_tokenizer=False)
