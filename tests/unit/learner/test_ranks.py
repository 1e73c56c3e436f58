"""``set_torch_threads``: ``rlmesh.learner.torch_threads`` sets a learner rank's intra-op threads."""

from __future__ import annotations

import pytest
import torch

from rlmesh.config import ConfigError, load_config
from rlmesh.learner.run.ranks import set_torch_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_positive_setting_becomes_the_ranks_thread_count(restore_threads):
    wanted = restore_threads + 1
    assert set_torch_threads(load_config(None, [f"rlmesh.learner.torch_threads={wanted}"])) == wanted
    assert torch.get_num_threads() == wanted


def test_zero_keeps_what_omp_num_threads_set(restore_threads):
    assert set_torch_threads(load_config(None, ["rlmesh.learner.torch_threads=0"])) == restore_threads
    assert torch.get_num_threads() == restore_threads


def test_a_negative_setting_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rlmesh\.learner\.torch_threads"):
        load_config(None, ["rlmesh.learner.torch_threads=-1"])
