import sys

from rlmesh_services.learner.main import main

sys.exit(main())
