"""A learner process for the checkpoint SIGKILL test (tests/integration/learner/test_checkpoint.py).

checkpoint_learner first  --model DIR --root ROOT --out FILE   step 1, checkpoint, step 2, half a checkpoint
checkpoint_learner resume --model DIR --root ROOT --out FILE   latest checkpoint, step 2, dump the state
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from rlmesh.learner import build_batch, latest_checkpoint
from rlmesh.learner.checkpoints import store as checkpoint_store
from tests.support.learner import PAD, ckpt_snapshot, ckpt_trainer, make_trajectories


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["first", "resume"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trainer = ckpt_trainer(args.model)
    if args.mode == "first":
        trainer.train_step(build_batch(make_trajectories(seed=11), PAD))
        extra = {"step": 1, "policy_version": 1, "cursor": 8, "used_uids": ["p0/0", "p0/1"]}
        trainer.save_checkpoint(os.path.join(args.root, "global_step_1"), extra)
        # Draws after the save: a resumed run must draw the same numbers.
        with open(args.out, "w") as f:
            json.dump({"rand": torch.rand(3).tolist()}, f)
        print("SAVED", flush=True)
        trainer.train_step(build_batch(make_trajectories(seed=12), PAD))

        def crash_before_complete(tmp, final):  # every rank wrote its files; COMPLETE not yet
            print("HALF", flush=True)
            time.sleep(3600)

        checkpoint_store.finalize_checkpoint_dir = crash_before_complete
        trainer.save_checkpoint(os.path.join(args.root, "global_step_2"), {"step": 2})
        return 1  # not reached: SIGKILL arrives while the second checkpoint is half-written
    path = latest_checkpoint(args.root)
    extra = trainer.load_checkpoint(path)
    rand = torch.rand(3).tolist()
    metrics = trainer.train_step(build_batch(make_trajectories(seed=12), PAD))
    torch.save({"path": path, "extra": extra, "rand": rand, **ckpt_snapshot(trainer, metrics)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
