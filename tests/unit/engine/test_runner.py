"""The engine's runners compute, for every row of a changing batch, what the model computes for
that row alone: rows join with prefills (some sharing a prompt), decode, leave, and join again."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.runner import HFCacheRunner, SlotRunner, make_runner
from rlmesh.models import build_tiny_model, build_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    out = build_tiny_model(
        tmp_path_factory.mktemp(request.param) / "m", build_tokenizer(), arch=request.param, hidden_size=64
    )
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def alone(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_make_runner_picks_slots_for_llama_family(model):
    assert isinstance(make_runner(model), SlotRunner)


@pytest.mark.parametrize("runner_cls", [SlotRunner, HFCacheRunner])
def test_rows_match_their_own_forward_through_joins_and_leaves(model, runner_cls):
    g = torch.Generator().manual_seed(0)
    runner = runner_cls(model)
    seqs: list[list[int]] = []  # each row's tokens so far, in the runner's row order

    def check(logits: torch.Tensor) -> None:
        assert logits.shape == (len(seqs), model.config.vocab_size)
        for row, ids in enumerate(seqs):
            torch.testing.assert_close(logits[row], alone(model, ids), atol=1e-5, rtol=0)

    def join(prompts: list[list[int]], copies: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = runner.prefill(prompts, copies)
        new = [list(p) for p, c in zip(prompts, copies, strict=True) for _ in range(c)]
        for row, ids in enumerate(new):
            torch.testing.assert_close(logits[row], alone(model, ids), atol=1e-5, rtol=0)
        seqs.extend(new)
        return logits

    def step() -> None:
        tokens = torch.randint(1, 90, (len(seqs),), generator=g)
        for ids, t in zip(seqs, tokens.tolist(), strict=True):
            ids.append(t)
        with torch.no_grad():
            check(runner.decode(tokens))

    join([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]], [2, 1, 3])
    assert runner.size == 6
    for _ in range(3):
        step()
    order = runner.retire([1, 2, 4])  # rows leave from the middle
    assert sorted(order) == [1, 2, 4]
    seqs[:] = [seqs[i] for i in order]
    step()
    join([list(range(20, 45))], [2])  # a longer prompt joins rows already decoding
    for _ in range(2):
        step()
    order = runner.retire([0, 4])
    seqs[:] = [seqs[i] for i in order]
    step()
    assert runner.retire([]) == [] and runner.size == 0
    seqs.clear()
    join([[3, 4]], [1])  # an emptied runner starts over
    step()


def test_slot_runner_grows_past_its_first_reservation(model):
    runner = SlotRunner(model)
    prompt = [7, 8, 9]
    with torch.no_grad():
        runner.prefill([prompt], [1])
        ids = list(prompt)
        for t in range(40):  # well beyond the first reservation of prompt length + 1
            logits = runner.decode(torch.tensor([t + 1]))
            ids.append(t + 1)
        runner.prefill([[1, 2]], [5])  # and more rows than slots reserved so far
    torch.testing.assert_close(logits[0], alone(model, ids), atol=1e-5, rtol=0)
    assert runner.size == 6
