"""The ready file a service writes once it serves: what ``rlmesh.runtime.launcher`` waits for and
reads (where the service listens, its pid)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path


def write_ready_file(path: str | os.PathLike[str], info: Mapping[str, object]) -> None:
    """``info`` as JSON at ``path``, through a rename: a reader never sees half a file."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(target)
