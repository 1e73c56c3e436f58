"""``python -m rlmesh_services.control``: the control service's ``main``."""

import sys

from rlmesh_services.control.main import main

sys.exit(main())
