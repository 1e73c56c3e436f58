from types import SimpleNamespace

import pytest

from rlmesh.data import PromptCursor, RLHFDataset, iter_batches
from tests.support.data import row, write


def take(sampler, sizes):
    return [sampler.next_indices(b) for b in sizes]


def test_shuffle_is_deterministic_per_seed_and_epoch():
    a, b, c = PromptCursor(50, seed=3), PromptCursor(50, seed=3), PromptCursor(50, seed=4)
    assert list(a.epoch_order(0)) == list(b.epoch_order(0)) != list(c.epoch_order(0))
    assert list(a.epoch_order(0)) != list(a.epoch_order(1))
    assert sorted(a.epoch_order(1)) == list(range(50))
    assert take(a, [10] * 12) == take(b, [10] * 12)


def test_no_shuffle_is_in_order():
    s = PromptCursor(5, shuffle=False)
    assert take(s, [2, 2, 2]) == [[0, 1], [2, 3], [0, 1]]  # drop_last: the tail [4] is skipped
    assert s.epoch == 1


def test_drop_last_never_spans_epochs():
    s = PromptCursor(10, seed=0)
    batches = take(s, [4] * 6)  # 2 batches per epoch, the last 2 items of each epoch skipped
    assert s.batches_per_epoch(4) == 2
    for e in range(3):
        order = list(s.epoch_order(e))
        assert batches[2 * e] + batches[2 * e + 1] == order[:8]


def test_wrap_fills_batches_across_epochs():
    s = PromptCursor(10, seed=0, drop_last=False)
    flat = [i for b in take(s, [4] * 5) for i in b]
    assert flat == list(s.epoch_order(0)) + list(s.epoch_order(1))
    assert (s.epoch, s.position) == (2, 0)
    assert take(s, [25])[0] == list(s.epoch_order(2)) + list(s.epoch_order(3)) + list(s.epoch_order(4))[:5]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5, 7])  # mid-epoch, at and across the boundaries
def test_resume_gives_the_uninterrupted_order(drop_last, stop_after):
    sizes = [3, 3, 3, 2, 3, 3, 3, 3, 3, 3]
    reference = take(PromptCursor(11, seed=9, drop_last=drop_last), sizes)
    first = PromptCursor(11, seed=9, drop_last=drop_last)
    got = take(first, sizes[:stop_after])
    state = first.state_dict()
    resumed = PromptCursor(11, seed=9, drop_last=drop_last)
    resumed.load_state_dict(dict(state))
    got += take(resumed, sizes[stop_after:])
    assert got == reference


def test_unseeded_resume_adopts_the_checkpoint_seed():
    a = PromptCursor(20)
    first = take(a, [5, 5, 5])
    state = a.state_dict()
    b = PromptCursor(20)  # another random seed...
    b.load_state_dict(state)  # ...replaced by the checkpoint's
    assert take(b, [5, 5]) == take(PromptCursor(20, seed=state["seed"]), [5] * 5)[3:]
    assert first == take(PromptCursor(20, seed=state["seed"]), [5] * 3)


def test_load_refuses_a_different_dataset_or_seed():
    state = PromptCursor(20, seed=1).state_dict()
    with pytest.raises(ValueError, match="20 prompts"):
        PromptCursor(21, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptCursor(20, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        PromptCursor(20, shuffle=False, seed=1).load_state_dict(state)


def test_bad_batch_sizes():
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptCursor(3).next_indices(4)
    with pytest.raises(ValueError, match="> 0"):
        PromptCursor(3).next_indices(0)
    with pytest.raises(ValueError, match="non-empty"):
        PromptCursor(0)


def test_items_from_config_and_validation_batches(tmp_path, tok):
    tr = write(tmp_path / "train.parquet", [row(f"q{i}", gt=str(i)) for i in range(6)])
    cfg = SimpleNamespace(train_files=str(tr), shuffle=True, seed=5, train_batch_size=4)
    ds = RLHFDataset.from_config(cfg, tok)
    s = PromptCursor.from_config(cfg, ds)
    batch = s.next_batch(cfg.train_batch_size)
    assert [i.index for i in batch] == list(PromptCursor(6, seed=5).epoch_order(0)[:4])
    assert [i.ground_truth for i in batch] == [str(i.index) for i in batch]
    with pytest.raises(TypeError):
        PromptCursor(6).next_batch(2)
    assert [[i.index for i in b] for b in iter_batches(ds, 4)] == [[0, 1, 2, 3], [4, 5]]
    assert [len(b) for b in iter_batches(ds, None)] == [6]


@pytest.mark.parametrize("drop_last", [True, False])
def test_epoch_of_next_is_the_epoch_the_batch_starts_in(drop_last):
    # 10 items in batches of 4: with drop_last the third batch skips the 2-item tail into epoch 1;
    # without it the third batch starts in epoch 0 and runs into epoch 1.
    cursor = PromptCursor(10, seed=0, drop_last=drop_last)
    starts = []
    for _ in range(5):
        starts.append(cursor.epoch_of_next(4))
        cursor.next_indices(4)
    assert starts == ([0, 0, 1, 1, 2] if drop_last else [0, 0, 0, 1, 1])
