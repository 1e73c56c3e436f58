"""``python -m rlmesh_services.learner``: the learner service's ``main``."""

import sys

from rlmesh_services.learner.main import main

sys.exit(main())
