"""``python -m rlmesh_services.rollout``: the rollout service's ``main``."""

import sys

from rlmesh_services.rollout.main import main

sys.exit(main())
