#!/bin/sh
# The GPU recipe (gpu_qwen2.5-0.5b_gsm8k.yaml) on a Ray cluster: every service a Ray actor, placed
# by the GPUs it asks for (docs/ray.md). Needs `pip install -e '.[gpu,cluster]'` on every node,
# the model in /models and GSM8K's parquet files in /data on every node (or a shared filesystem),
# and a cluster started first:
#   ray start --head --port=6379              # on the first machine
#   ray start --address=HEAD:6379             # on each of the others (their GPUs are found)
# then, from any node:  RAY_ADDRESS=HEAD:6379 sh examples/gpu_qwen2.5-0.5b_gsm8k.ray.sh
# Four SGLang replicas (each asks for its tensor-parallel size in GPUs), a learner of four ranks
# on one node (four GPUs) that also computes the reference log-probs (Ray gives a GPU to one actor
# only, so the reference cannot share the learner's), the reward on a CPU: Ray's defaults for this
# config; --num-gpus SERVICE=N and --resources change them. Stop it early with `rlmesh ray down --address HEAD:6379`.
set -eu
exec rlmesh ray up -c examples/gpu_qwen2.5-0.5b_gsm8k.yaml --address "${RAY_ADDRESS:-auto}" \
    rlmesh.run_id=gsm8k-ray rlmesh.rollout.replicas=4 rlmesh.learner.ranks=4 rlmesh.reference.colocated=true \
    trainer.default_local_dir=/data/rlmesh/gsm8k-ray/checkpoints "$@"
