"""Control service: the REST control plane (FastAPI, OpenAPI at /docs) over a running job's
learner, replicas, reward services and queues, with opt-in automatic responses. Settings are the
``rlmesh.control.*`` config keys; the app is ``rlmesh.control``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlmesh.control.service import main as control_main


def main(argv: Sequence[str] | None = None) -> int:
    return control_main(argv)


if __name__ == "__main__":
    sys.exit(main())
