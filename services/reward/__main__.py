"""``python -m rlmesh_services.reward``: the reward service's ``main``."""

import sys

from rlmesh_services.reward.main import main

sys.exit(main())
