"""The format learner and engine share stands alone: importing it loads neither side."""

import subprocess
import sys

CHECK = """
import sys
import rlmesh.weights.bucket, rlmesh.weights.group
print(" ".join(m for m in sys.modules if m.startswith(("rlmesh.learner", "rlmesh.engine"))))
"""


def test_the_weights_package_loads_nothing_of_the_learner_or_the_engine():
    loaded = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == []
