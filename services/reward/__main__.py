import sys

from rlmesh_services.reward.main import main

sys.exit(main())
