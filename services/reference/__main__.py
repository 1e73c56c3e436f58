"""``python -m rlmesh_services.reference``: the reference service's ``main``."""

import sys

from rlmesh_services.reference.main import main

sys.exit(main())
