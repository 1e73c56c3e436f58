"""Run by torchrun with 2 ranks (tests/integration/learner/test_colocated_reference.py): each rank
loads the colocated reference and scores 7 samples; each writes how many rows its own forwards
took and the whole batch's log-probs to OUT_DIR/rank<R>.json.

``python -m tests.support.programs.colocated_reference_ranks MODEL OUT_DIR [OVERRIDE ...]``"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(model: str, out_dir: Path, overrides: list[str]) -> int:
    import rlmesh.learner.ppo.colocated_reference as colocated
    from rlmesh.learner import build_batch
    from rlmesh.learner.dist import init_distributed, shutdown_distributed
    from tests.support.learner import PAD, make_config, make_trajectories

    init_distributed("gloo")
    cfg = make_config(model, *overrides, "rlmesh.reference.colocated=true")
    reference = colocated.colocated_reference(cfg, "cpu")
    assert reference is not None
    rows = [0]
    slice_micro_batch = colocated.slice_micro_batch

    def counted(batch, picked, device="cpu"):  # the rows this rank's own forwards take
        rows[0] += len(picked)
        return slice_micro_batch(batch, picked, device)

    colocated.slice_micro_batch = counted
    batch = build_batch(make_trajectories(n_prompts=4, n=2, seed=11, with_ref=False)[:7], PAD)
    log_probs = reference.log_probs(batch)
    rank = os.environ["RANK"]
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rows": rows[0], "log_probs": log_probs.tolist()}))
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
