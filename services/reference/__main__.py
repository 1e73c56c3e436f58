import sys

from rlmesh_services.reference.main import main

sys.exit(main())
