import sys

from rlmesh_services.rollout.main import main

sys.exit(main())
