"""trainer.device as a machine can honour it."""

from __future__ import annotations

import logging

import pytest

from rlmesh.learner.dist import learner_device


def test_cuda_without_a_gpu_trains_on_the_cpu_and_says_so(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="rlmesh.learner"):
        assert learner_device("cuda", cuda_available=False) == "cpu"
    assert "trainer.device=cuda but this machine has no CUDA device" in caplog.text


def test_cpu_stays_on_the_cpu_beside_gpus_and_cuda_uses_them(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="rlmesh.learner"):
        assert learner_device("cpu", cuda_available=True) == "cpu"
        assert learner_device("cuda", cuda_available=True) == "cuda"
        assert learner_device("cpu", cuda_available=False) == "cpu"
    assert not caplog.text
