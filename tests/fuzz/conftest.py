import os

from hypothesis import settings

# `make test`: the same 20 examples per property on every run (main stays green on a fixed
# sample); `make fuzz`: many more, drawn at random (HYPOTHESIS_PROFILE=fuzz).
settings.register_profile("ci", max_examples=20, derandomize=True, print_blob=True)
settings.register_profile("fuzz", max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
