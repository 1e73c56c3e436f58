"""Environment defaults for a process on a machine without a GPU."""

from __future__ import annotations

import shutil
from collections.abc import MutableMapping


def quiet_deepspeed_on_cpu(env: MutableMapping[str, str]) -> None:
    """Without ``nvidia-smi``, names DeepSpeed's accelerator (``DS_ACCELERATOR=cpu``) unless set:
    transformers imports DeepSpeed, which otherwise warns while probing for a GPU that is not there."""
    if shutil.which("nvidia-smi") is None:
        env.setdefault("DS_ACCELERATOR", "cpu")
