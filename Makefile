# rlmesh — the README's commands are `make demo`, `rlmesh train` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# One intra-op thread per process: torch's default oversubscribes small machines (~17x slower).
export OMP_NUM_THREADS ?= 1
# DeepSpeed's CPU accelerator where there is no NVIDIA GPU.
ifeq ($(shell command -v nvidia-smi),)
export DS_ACCELERATOR ?= cpu
endif

.PHONY: help venv lock redis-server test-tools demo demo-seeds test test-e2e sglang-contract gpu-smoke lock-gpu gpu-lock-check ray-test compose-env compose-test security-test chaos fuzz lint format docs protos bench bench-queue bench-rollout bench-score bench-learner bench-algo bench-all bench-soak bench-peer bench-peer-grpo bench-async bench-scale bench-push-groups bench-autoscale bench-preflight bench-startup bench-checkpoint clean

help:
	@echo "make demo    set everything up, then run the main job"
	@echo "make test    run the test suite (CI runs it, then make chaos: .ci/run)"
	@echo "make lint    ruff;  make protos  regenerate gRPC code;  make bench  benchmarks"
	@echo "make bench-peer  TRL 1.12's PPO and rlmesh on one task (PEER_ARGS='--steps 100 --seed 0')"
	@echo "make bench-peer-grpo  TRL's GRPOTrainer and rlmesh's GRPO on the long-tail task"

# torch goes in first and alone, pinned, so nothing afterwards can pull a CUDA build;
# every later install is constrained to the same version.
$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@$(BIN)/python -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), f'torch {v} != 2.13.0'"
	@touch $@

venv: $(VENV)/.installed

# The `gpu` extra's lock (constraints-gpu.txt: sglang, torch and transformers as sglang pins them):
# write it from pip's resolver, or check that `.[gpu]` still resolves to it (a dry run, ~1 minute,
# metadata only). Neither needs a GPU; the CUDA image builds with it (docs/deploy.md).
lock-gpu:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv && .lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python deploy/gpu_lock.py write && rm -rf .lock-venv

gpu-lock-check:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv && .lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python deploy/gpu_lock.py check && rm -rf .lock-venv

# Re-resolve every dependency to the newest release pyproject.toml allows, in a throw-away venv,
# and write the result to constraints.txt (keeping its header). Measure the README's figures again
# after a re-lock.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python -m pip install -q torch==2.13.0
	.lock-venv/bin/python -m pip install -q -c <(echo torch==2.13.0) -e '.[dev]'
	{ grep '^#' constraints.txt; .lock-venv/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed 's/+cpu$$//'; } > constraints.lock.tmp
	mv constraints.lock.tmp constraints.txt && rm -rf .lock-venv

redis-server:
	@command -v redis-server >/dev/null || { \
		echo "redis-server is missing: installing it with apt"; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }

# What the tests drive besides Python: Prometheus (promtool checks the alert rules, a real server
# scrapes a run) and Chromium with its driver (the dashboard's browser test).
test-tools: redis-server
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v chromium >/dev/null \
		&& command -v chromedriver >/dev/null || { \
		echo "prometheus, chromium or chromium-driver is missing: installing them with apt"; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q prometheus chromium chromium-driver; }

demo: venv redis-server
	$(BIN)/rlmesh demo $(DEMO_ARGS)

# The seeds' table of docs/quickstart.md: the demo for seeds 0, 1 and 2 (about 10 minutes each, warm-ups cached after).
demo-seeds: venv redis-server
	$(BIN)/python benchmarks/demo_seeds.py $(DEMO_ARGS)

# The test suite: every test but the scenarios with targets of their own (chaos, ray, compose,
# security, sglang's contract), tests/e2e's whole jobs included, side by side on pytest-xdist
# workers: the whole jobs in two lanes of one job at a time, the rest a module per worker at a
# time (tests/conftest.py), longest first (--no-loadscope-reorder keeps that order).
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
test: venv redis-server test-tools
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) -m "not chaos and not ray and not compose and not sglang_contract and not security" --durations=25

# Only the whole-job tests of tests/e2e (`make test` runs them too), in their two lanes:
# the demo's lift, rlmesh train on a user's own model and data, resume, the estimators and losses,
# DAPO, LoRA, several learner ranks, the control plane, the dashboard and the monitoring stack.
test-e2e: venv redis-server test-tools
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "e2e and not ray and not compose" --durations=25 tests/e2e

# rlmesh against SGLang's own code (tests/contract; about 2 minutes once its venv is built, which takes
# a few more the first time): a replica's flags through sglang 0.5.23's ServerArgs parser, every request
# through its real HTTP app. Its own venv, since sglang's CUDA dependencies never enter .venv.
SGLANG_VENV := .sglang-venv
$(SGLANG_VENV)/.installed: tests/support/sglang-requirements.txt
	rm -rf $(SGLANG_VENV) && $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -r tests/support/sglang-requirements.txt
	@touch $@

sglang-contract: venv $(SGLANG_VENV)/.installed
	RLMESH_SGLANG_PYTHON=$(SGLANG_VENV)/bin/python $(BIN)/python -m pytest -q -p no:cacheprovider -m sglang_contract tests/contract

# On a machine with a GPU (never needed by `make test`): the driver, torch's CUDA and sglang; one learner
# DeepSpeed step on CUDA; with sglang installed, a 5-step job on SGLang. One JSON line at the end.
gpu-smoke: venv
	$(BIN)/python -m rlmesh.job.gpu_smoke

# rlmesh ray up on a real two-node local Ray cluster (the `cluster` extra; about 9 minutes; not part
# of `make test`): placement by custom resources, a replica actor killed and restarted, ray down, SIGTERM.
ray-test: venv redis-server
	$(BIN)/python -m pip install -q -c constraints.txt 'ray[default]>=2.30'
	$(BIN)/python -m pytest -q -s -p no:cacheprovider -m ray tests/e2e/test_ray.py

# The compose stack's two secrets (docs/security.md) in .env, which docker-compose reads, mode 0600;
# an existing .env is kept.
compose-env:
	@if [ -f .env ]; then echo ".env exists: kept"; else \
		umask 077 && python3 -c 'import secrets; print("RLMESH_AUTH_TOKEN=" + secrets.token_hex(32)); print("RLMESH_REDIS_PASSWORD=" + secrets.token_hex(32))' > .env \
		&& echo "wrote .env (mode 0600): RLMESH_AUTH_TOKEN and RLMESH_REDIS_PASSWORD"; fi

# docker-compose.yml for real (about 15 minutes; the first image build more): builds the images
# (a Debian base made with debootstrap when no registry is reachable), runs --scale rollout=3,
# adds a fourth replica and stops a first one mid-run, and checks the run (docs/deploy.md).
compose-test: venv redis-server
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null || { \
		echo "docker.io, docker-compose or debootstrap is missing: installing them with apt"; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q docker.io docker-compose debootstrap; }
	$(BIN)/python -m pytest -q -s -p no:cacheprovider -m compose tests/e2e/test_compose.py

# The attacker's suite (docs/security.md): a running job attacked on every port and through Redis
# by someone without the token; it must refuse, go on, and leak no secret (about 2 minutes).
security-test: venv redis-server
	$(BIN)/python -m pytest -q -s -p no:cacheprovider -m security tests/security

# The chaos suite (whole jobs through kill -9 of every process and a network partition, about 4
# minutes; not part of `make test`, but of .ci/run after it), printing how long each recovery took.
# One scenario at a time: each measures how long its job takes to recover.
chaos: venv redis-server
	$(BIN)/python -m pytest -q -s -p no:cacheprovider -m chaos tests/chaos

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

docs: venv
	$(BIN)/python -m rlmesh.config.docs

protos: venv
	$(BIN)/python -m rlmesh.wire.protogen

# The fuzz tests with many random draws (`make test` runs a fixed sample of 20 per property).
fuzz: venv redis-server
	FUZZ_EXAMPLES=1000 $(BIN)/python -m pytest -q -p no:cacheprovider tests/fuzz

# 1,000 demo steps with a replica killed every 100: memory, Redis and disk growth (~30 min).
bench-soak: venv redis-server
	$(BIN)/python benchmarks/bench_soak.py $(SOAK_ARGS)

# Benchmarks print their results; none of them is a test (see each script's docstring).
bench: venv redis-server
	$(BIN)/python benchmarks/bench_pipeline.py

bench-queue: venv redis-server
	$(BIN)/python benchmarks/bench_queue.py

bench-rollout: venv
	$(BIN)/python benchmarks/bench_rollout.py

bench-score: venv redis-server
	$(BIN)/python benchmarks/bench_score.py

bench-learner: venv
	$(BIN)/python benchmarks/bench_learner.py

bench-algo: venv
	$(BIN)/python benchmarks/bench_logprobs.py

# TRL's PPOTrainer (trl 1.12.0, the last release with PPO) in its own venv, then rlmesh, on one task
# from one SFT checkpoint: wall times, accuracies, the ratio (about 30 minutes on 2 cores).
# Options: PEER_ARGS='--steps 100 --seed 0 --runs trl,trl-knobs,fast' (python benchmarks/bench_peer.py -h).
TRL_VENV := .venv-trl
# A TRL venv: $(1) its folder, $(2) the trl release; torch first and pinned, as for the main venv.
define trl_venv
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q -c constraints.txt trl==$(2)
	@$(1)/bin/python -c "import torch, trl; assert torch.__version__.startswith('2.13.0') and trl.__version__ == '$(2)', (torch.__version__, trl.__version__)"
	@touch $(1)/.installed
endef
$(TRL_VENV)/.installed: constraints.txt
	$(call trl_venv,$(TRL_VENV),1.12.0)

bench-peer: venv redis-server $(TRL_VENV)/.installed
	$(BIN)/python benchmarks/bench_peer.py $(PEER_ARGS)

# TRL's GRPOTrainer (its current release, 1.16.0) in a venv of its own, then rlmesh's GRPO, on the
# long-tail task from bench-async's SFT checkpoint, two seeds (about 70 minutes on 2 cores).
# Options: PEER_GRPO_ARGS='--seeds 0 --steps 20 --runs trl,sync,stale1,partial' (python benchmarks/bench_peer_grpo.py -h).
TRL_GRPO_VENV := .venv-trl-grpo
$(TRL_GRPO_VENV)/.installed: constraints.txt
	$(call trl_venv,$(TRL_GRPO_VENV),1.16.0)

bench-peer-grpo: venv redis-server $(TRL_GRPO_VENV)/.installed
	$(BIN)/python benchmarks/bench_peer_grpo.py $(PEER_GRPO_ARGS)

# The long-tail task four ways (synchronous, max_staleness=1, partial + in-flight, over-provisioned), three seeds, from one
# SFT checkpoint (cached under runs/bench-async); ASYNC_ARGS='--seeds 0 --steps 20' for a shorter run.
bench-async: venv redis-server
	$(BIN)/python benchmarks/bench_async.py $(ASYNC_ARGS)

# One step's trajectories through one Redis and the learner's collector, demo-sized to 7B-shaped
# (16k x 4k tokens), weight pushes to up to 64 engines, and fleets of 1, 8 and 32 whole replicas
# (about 15 minutes, 7 GB of memory): SCALE_ARGS='--points 1024x512 --push "" --replicas 64,128'.
bench-scale: venv redis-server
	$(BIN)/python benchmarks/bench_scale.py $(SCALE_ARGS)

# Weight pushes to engines on hosts of their own (network namespaces, links shaped to 1 Gbit/s): a
# group per engine against one shared group, time and bytes out of the learner (needs root; about
# 10 minutes): PUSH_GROUPS_ARGS='--engines 4,8 --rate-mbit 250'.
bench-push-groups: venv
	$(BIN)/python benchmarks/bench_push_groups.py $(PUSH_GROUPS_ARGS)

# How long the autoscaler's fleet takes to follow a step in load up and down, on simulated engines,
# with the audit (two runs at rlmesh's default settings, about 10 minutes): AUTOSCALE_ARGS='--settings fast --runs 1'.
bench-autoscale: venv redis-server
	$(BIN)/python benchmarks/bench_autoscale.py $(AUTOSCALE_ARGS)

# Each pre-flight mistake's `rlmesh config validate`, timed (under a minute).
bench-preflight: venv
	$(BIN)/python benchmarks/bench_preflight.py $(PREFLIGHT_ARGS)

# Launch to first step and last step to exit of the demo's job, phase by phase (a few minutes):
bench-startup: venv redis-server
	$(BIN)/python benchmarks/bench_startup.py $(STARTUP_ARGS)

# What trainer.save_freq=1 costs the demo's step, written in the background and in the step (minutes):
bench-checkpoint: venv redis-server
	$(BIN)/python benchmarks/bench_checkpoint.py $(CHECKPOINT_ARGS)

bench-all: bench-queue bench-rollout bench-score bench-learner bench-algo bench

clean:
	rm -rf $(VENV) $(TRL_VENV) $(TRL_GRPO_VENV) .pytest_cache .ruff_cache .hypothesis
