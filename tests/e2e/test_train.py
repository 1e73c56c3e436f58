"""``rlmesh train`` as a verl user runs it: their own model, data and reward, nothing from rlmesh.

Everything is built here the way a user would: a tiny HF Llama from a ``LlamaConfig``, its own
word-level tokenizer (the ``tokenizers`` library, no chat template), Parquet files in verl's layout
whose ``prompt`` column holds raw strings, a reward file with verl's ``compute_score`` and a YAML
config with verl's keys. The job runs as a subprocess, as a user starts it from a shell.

The task: a prompt names a digit ("say 7", "please repeat the word 7", ...); the reward is the
fraction of response words equal to it. A random model sampling from a 20-word vocabulary hits it
now and then, so training scores vary from the first step.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlmesh.job.preflight import DRY_ROWS
from tests.support.processes import child_env
from tests.support.repo import REPO

SPECIALS = ["<pad>", "<unk>", "<eos>"]
DIGITS = [str(d) for d in range(10)]
PROMPT_WORDS = ["say", "please", "repeat", "the", "number", "word", "now"]
# Prompts of different lengths (1 to 5 words before the digit): the HF check pads them on the left.
TEMPLATES = ["say {}", "repeat {}", "say the number {}", "please repeat the word {}", "say {} now"]
MAX_RESPONSE = 4
STEPS = 3  # the first run
MORE_STEPS = 5  # the resumed run
SOURCE = "my_task"
DRY_CALLS = 2 * DRY_ROWS  # the pre-flight calls the reward on the first train rows, twice each

REWARD_FILE = '''"""My own reward: the fraction of response words that are the asked-for digit."""

import json

MARKER = {marker!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    words = solution_str.split()
    score = sum(w == ground_truth for w in words) / len(words) if words else 0.0
    # A trace of every call, so the test can tell this function (and not a built-in) scored.
    with open(MARKER, "a") as f:
        f.write(json.dumps({{"data_source": data_source, "solution": solution_str,
                            "ground_truth": ground_truth, "extra_info": extra_info,
                            "score": score}}) + "\\n")
    return score
'''

CONFIG = """\
data:
  train_files: {train}
  val_files: {val}
  train_batch_size: 8
  max_prompt_length: 8
  max_response_length: {max_response}

actor_rollout_ref:
  model:
    path: {model}
    enable_gradient_checkpointing: false
  actor:
    ppo_mini_batch_size: 4
    ppo_micro_batch_size_per_gpu: 16
    use_kl_loss: true
    kl_loss_coef: 0.001
    kl_loss_type: low_var_kl
    optim:
      lr: 1.0e-3
    deepspeed_config:
      zero_stage: 0
      dtype: float32
  rollout:
    name: embedded
    n: 4
    dtype: float32
    tensor_model_parallel_size: 1
    log_prob_micro_batch_size_per_gpu: 32
  ref:
    log_prob_micro_batch_size_per_gpu: 32

algorithm:
  adv_estimator: grpo
  use_kl_in_reward: false

custom_reward_function:
  path: {reward}
  name: compute_score

trainer:
  device: cpu
  n_gpus_per_node: 0
  total_training_steps: {steps}
  save_freq: 2
  max_actor_ckpt_to_keep: 1
  test_freq: {steps}
  val_before_train: true
  log_val_generations: 2
  logger: [console, tensorboard]
  project_name: byo
  experiment_name: digits
  default_local_dir: {run_dir}

rlmesh:
  rollout:
    replicas: 1
"""


@dataclass
class UserFiles:
    model: Path
    vocab: dict[str, int]
    val_prompts: list[str]
    val_truths: list[str]
    reward: Path
    marker: Path
    config: Path
    run_dir: Path


def build_model_and_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIALS, *DIGITS, *PROMPT_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    assert not tokenizer.chat_template
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return vocab


def write_parquet(path: Path, split: str, count: int, seed: int) -> tuple[list[str], list[str]]:
    """verl's layout with a raw-string prompt column (no chat messages)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, truths = [], []
    for i in range(count):
        digit = DIGITS[int(torch.randint(10, (1,), generator=gen))]
        prompts.append(TEMPLATES[i % len(TEMPLATES)].format(digit))
        truths.append(digit)
    table = pa.Table.from_pylist(
        [
            {
                "data_source": SOURCE,
                "prompt": p,
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": t},
                "extra_info": {"split": split, "index": i},
            }
            for i, (p, t) in enumerate(zip(prompts, truths, strict=True))
        ]
    )
    pq.write_table(table, path)
    return prompts, truths


def write_config(path: Path, **fields: object) -> Path:
    path.write_text(CONFIG.format(max_response=MAX_RESPONSE, **fields))
    return path


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> UserFiles:
    root = tmp_path_factory.mktemp("byo")
    model = root / "my-llama"
    vocab = build_model_and_tokenizer(model)
    data = root / "data"
    data.mkdir()
    write_parquet(data / "train.parquet", "train", 64, seed=1)
    val_prompts, val_truths = write_parquet(data / "val.parquet", "val", 20, seed=2)
    marker = root / "reward-calls.jsonl"
    reward = root / "my_reward.py"
    reward.write_text(REWARD_FILE.format(marker=str(marker)))
    run_dir = root / "run"
    config = write_config(
        root / "my_job.yaml",
        train=data / "train.parquet",
        val=data / "val.parquet",
        model=model,
        reward=reward,
        steps=STEPS,
        run_dir=run_dir,
    )
    return UserFiles(model, vocab, val_prompts, val_truths, reward, marker, config, run_dir)


def rlmesh_train(config: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "train", "-c", str(config), *overrides],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_reward(path: Path):
    spec = importlib.util.spec_from_file_location("users_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def greedy_score(actor: Path, user: UserFiles) -> float:
    """The exported actor's greedy score on the val prompts, by plain HF generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(actor)
    tok.padding_side = "left"
    enc = tok(user.val_prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert len(set(map(len, tok(user.val_prompts)["input_ids"]))) > 1  # left padding is exercised
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=MAX_RESPONSE,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    score = load_reward(user.reward)
    return sum(score(SOURCE, t, g, {}) for t, g in zip(texts, user.val_truths, strict=True)) / len(texts)


def summary_of(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def progress_steps(proc: subprocess.CompletedProcess[str]) -> list[tuple[int, int]]:
    """(step, total) of each progress line ``rlmesh train`` printed."""
    return [(int(m[1]), int(m[2])) for m in re.finditer(r"^\[train\] step +(\d+)/(\d+) ", proc.stdout, re.M)]


@pytest.mark.timeout(420)
def test_own_llama_tokenizer_data_and_reward_train_export_and_resume(user):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    # --- the first run: STEPS steps, validation before and after --------------------------------
    first = rlmesh_train(user.config)
    summary = summary_of(first)
    # One progress line per step, none missed (a step can be shorter than a poll of the learner).
    assert progress_steps(first) == [(s, STEPS) for s in range(1, STEPS + 1)], first.stdout
    rows = read_rows(user.run_dir)
    assert [int(r["step"]) for r in rows] == list(range(STEPS + 1))  # step 0 is validation only
    train_rows = [r for r in rows if r["step"] > 0]
    for r in train_rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean", "timing_s/step"):
            assert key in r, (r["step"], key)
    assert [r["step"] for r in rows if "val/score" in r] == [0, STEPS]
    # trainer.log_val_generations: two of each validation's samples, the user's own prompts.
    generations = [json.loads(ln) for ln in (user.run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [0, STEPS]
    assert all(len(g["samples"]) == 2 for g in generations)
    assert {s["input"] for g in generations for s in g["samples"]} <= set(user.val_prompts)
    # The tensorboard sink, read back: every step's score scalar.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(user.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("critic/score/mean")] == list(range(1, STEPS + 1))
    assert summary["steps"] == STEPS
    assert summary["acc_before"] == rows[0]["val/score"] and summary["acc_after"] == rows[-1]["val/score"]
    assert Path(summary["checkpoint_dir"]) == user.run_dir
    # Saved at step 2 and at the last step; max_actor_ckpt_to_keep=1 kept the newest only.
    assert sorted(p.name for p in user.run_dir.glob("global_step_*")) == [f"global_step_{STEPS}"]

    # The reward file scored: every call of it is in its trace, for training and validation, with
    # the data source, ground truth and extra_info of the user's Parquet rows (a built-in would not
    # know "my_task" and score nothing).
    calls = [json.loads(line) for line in user.marker.read_text().splitlines()]
    assert {c["data_source"] for c in calls} == {SOURCE}
    by_split = {s: [c for c in calls if (c["extra_info"] or {}).get("split") == s] for s in ("train", "val")}
    # batch x n, each sample scored once, and the pre-flight's dry calls on the first train rows
    assert len(by_split["train"]) == STEPS * 8 * 4 + DRY_CALLS
    assert len(by_split["val"]) == 2 * len(user.val_prompts)  # before and after
    assert all(c["ground_truth"] in DIGITS for c in calls)
    # Responses are decoded with the user's word-level tokenizer: vocabulary words between spaces.
    assert all(w in user.vocab for c in calls for w in c["solution"].split())
    assert max(r["critic/score/mean"] for r in train_rows) > 0  # the random policy hits sometimes

    # --- the exported actor: the user's Llama and tokenizer with trained weights ----------------
    actor = Path(summary["exported_actor"])
    assert actor == user.run_dir / "actor-hf"
    model = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM) and model.config.model_type == "llama"
    tok = AutoTokenizer.from_pretrained(actor)
    assert tok.get_vocab() == user.vocab and not tok.chat_template
    assert type(tok.backend_tokenizer.model).__name__ == "WordLevel"
    words = ["please", "repeat", "the", "word", "7"]
    assert tok(" ".join(words))["input_ids"] == [user.vocab[w] for w in words]
    initial = AutoModelForCausalLM.from_pretrained(user.model, dtype=torch.float32).state_dict()
    trained = model.state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "training changed no weight"

    # Validation runs on the rollout replica with the weights pushed after the last step; a plain
    # HF generate of the exported checkpoint must score the same on the same prompts (one val
    # prompt is 5 points, one response word at least 1.25, so "within 1 point" means equal).
    assert greedy_score(actor, user) == pytest.approx(rows[-1]["val/score"], abs=0.01)

    # --- the same command again, with more steps: resumes from global_step_STEPS -----------------
    again = rlmesh_train(user.config, f"trainer.total_training_steps={MORE_STEPS}")
    resumed = summary_of(again)
    assert f"[train] resumed from the checkpoint of step {STEPS}\n" in again.stdout, again.stdout
    assert progress_steps(again) == [(s, MORE_STEPS) for s in range(STEPS + 1, MORE_STEPS + 1)], again.stdout
    rows = read_rows(user.run_dir)
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(MORE_STEPS + 1)), steps  # STEPS + 1 first, none repeated
    assert [r["training/policy_version"] for r in rows[1:]] == list(range(1, MORE_STEPS + 1))
    assert resumed["steps"] == MORE_STEPS and resumed["run_id"] != summary["run_id"]
    learner_log = user.run_dir / "services" / resumed["run_id"] / "logs" / "learner.log"
    assert f"resuming from {user.run_dir / f'global_step_{STEPS}'}" in learner_log.read_text()
    calls = [json.loads(line) for line in user.marker.read_text().splitlines()]
    assert (
        sum((c["extra_info"] or {}).get("split") == "train" for c in calls)
        == MORE_STEPS * 8 * 4 + 2 * DRY_CALLS
    )
    # The re-export is the resumed run's last step, and scores as its last validation did.
    assert greedy_score(Path(resumed["exported_actor"]), user) == pytest.approx(
        rows[-1]["val/score"], abs=0.01
    )

    # --- trainer.val_only: validates the resumed policy, trains nothing --------------------------
    checkpoints = sorted(p.name for p in user.run_dir.glob("global_step_*"))
    calls_before = len(user.marker.read_text().splitlines())
    val_only = rlmesh_train(
        user.config, f"trainer.total_training_steps={MORE_STEPS}", "trainer.val_only=true"
    )
    summary_of(val_only)
    assert progress_steps(val_only) == [], val_only.stdout
    new_rows = read_rows(user.run_dir)[len(rows) :]
    assert len(new_rows) == 1 and new_rows[0]["step"] == MORE_STEPS, new_rows
    assert "actor/pg_loss" not in new_rows[0]
    assert new_rows[0]["val/score"] == pytest.approx(rows[-1]["val/score"], abs=0.01)  # the same policy
    assert sorted(p.name for p in user.run_dir.glob("global_step_*")) == checkpoints
    after = [json.loads(line) for line in user.marker.read_text().splitlines()][calls_before:]
    splits = ["train"] * DRY_CALLS + ["val"] * len(user.val_prompts)  # the pre-flight's first
    assert [(c["extra_info"] or {}).get("split") for c in after] == splits


def failure_line(proc: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    """The one ``rlmesh train: ...; its log: PATH`` line on stderr, and PATH."""
    assert proc.returncode not in (0, None), proc.stdout[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlmesh train:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert "; its log: " in line, line
    log = Path(line.rsplit("; its log: ", 1)[1].strip())
    assert log.is_file(), line
    return line, log


@pytest.mark.timeout(240)
def test_a_service_that_cannot_start_fails_the_job_naming_it_and_its_log(user, tmp_path):
    # Past the pre-flight (which would catch it first, below), a reward file that does not exist
    # fails the reward service at start-up.
    missing = tmp_path / "no_such_reward.py"
    proc = rlmesh_train(
        user.config,
        "--skip-preflight",
        f"custom_reward_function.path={missing}",
        f"trainer.default_local_dir={tmp_path / 'a'}",
    )
    line, log = failure_line(proc)
    assert "reward" in line and log.name == "reward.log", line
    assert "no such file" in log.read_text() and str(missing) in log.read_text()

    # The pre-flight catches each of these before any service starts: exit 2, the file named.
    broken = tmp_path / "broken_reward.py"
    broken.write_text(
        "raise RuntimeError('my reward needs a GPU')\n\ndef compute_score(**kw):\n    return 0.0\n"
    )
    rows = pq.read_table(user.config.parent / "data" / "val.parquet").to_pylist()
    rows[3]["prompt"] = ""  # row 3 of the val file: an empty prompt
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad_val.parquet")
    for name, override, expected in (
        ("b", f"custom_reward_function.path={missing}", str(missing)),
        ("c", f"custom_reward_function.path={broken}", f"RuntimeError: my reward needs a GPU, at {broken}:1"),
        (
            "d",
            f"data.val_files={tmp_path / 'bad_val.parquet'}",
            f"{tmp_path / 'bad_val.parquet'}, row 3, column 'prompt': empty prompt",
        ),
    ):
        proc = rlmesh_train(user.config, override, f"trainer.default_local_dir={tmp_path / name}")
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert expected in proc.stderr, proc.stderr
        assert not (tmp_path / name).exists()  # nothing started, nothing written


@pytest.mark.timeout(300)
def test_attaches_to_redis_and_a_reward_service_already_running(user, tmp_path):
    """Given rlmesh.redis_url and rlmesh.reward.addresses, rlmesh train starts neither and uses them;
    with a Redis password and rlmesh.auth_token, which every call (engines' HTTP API and the
    learner's weight pushes included) then carries, and which no log or summary shows."""
    import redis as redis_client

    from rlmesh.config.secrets import redact_url
    from rlmesh.job.stack import free_port_overrides
    from rlmesh.runtime.launcher import ProcessLauncher

    token, redis_password = "e2e-token-6b1", "e2e-redis-pw-2f"
    run_dir = tmp_path / "attached-run"
    with ProcessLauncher(tmp_path / "theirs") as theirs:
        redis = theirs.start_redis(password=redis_password)
        reward = theirs.start_service(
            "reward",
            config_path=user.config,
            overrides=[
                f"rlmesh.redis_url={redis.url}",
                f"rlmesh.auth_token={token}",
                *free_port_overrides("reward"),
            ],
        )
        calls_before = len(user.marker.read_text().splitlines()) if user.marker.exists() else 0
        proc = rlmesh_train(
            user.config,
            f"rlmesh.redis_url={redis.url}",
            f"rlmesh.auth_token={token}",
            f"rlmesh.reward.addresses=['{reward.grpc_address}']",
            f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "rlmesh.run_id=attached",
        )
        summary = summary_of(proc)
        assert summary["steps"] == 1
        assert re.search(
            rf"^\[train\] redis +{re.escape(redact_url(redis.url))} \(given: not started here\)",
            proc.stdout,
            re.M,
        )
        assert re.search(r"^\[train\] reward +\S+ \(given: not started here\)", proc.stdout, re.M)
        logs = {p.stem for p in (run_dir / "services" / "attached" / "logs").iterdir()}
        assert "reward" not in logs and "redis" not in logs and {"reference", "rollout-0", "learner"} <= logs
        # Their reward service scored this run's samples and their Redis holds this run's streams.
        assert len(user.marker.read_text().splitlines()) - calls_before >= 8 * 4
        assert reward.process.alive() and redis.process.alive()
        keys = redis_client.Redis.from_url(redis.url).keys("rlmesh:{attached}:*")
        assert keys, "the run left nothing in the given Redis"
        # The engine's counters came back through its token (else the summary says it could not).
        assert "could not read the engine counters" not in proc.stdout
        service_logs = "".join(
            p.read_text(errors="replace") for p in (run_dir / "services" / "attached" / "logs").iterdir()
        )
        assert "answered 401" not in service_logs and "dropped from the push" not in service_logs
        for text in (proc.stdout, proc.stderr, service_logs):
            assert token not in text and redis_password not in text


# Generation a step ahead with half a batch more in flight (APRIL): a resume must take up what
# the checkpoint had in flight, each prompt trained once.
AHEAD = [
    "rlmesh.max_staleness=1",
    "rlmesh.over_provision=0.5",
    "algorithm.rollout_correction.rollout_is=token",
]
IN_FLIGHT = 8 * 2 + 4  # train_batch_size x (max_staleness + 1) + ceil(0.5 x 8)


def audit_prompts_of_an_ahead_run(run_dir: Path, last_step: int) -> None:
    """Across the learners that ran it, every prompt the data cursor handed out was trained once or
    is in flight in the last checkpoint, none twice; and every step began with IN_FLIGHT groups in
    flight."""
    from rlmesh.data import PromptCursor
    from tests.support.jobs import standing_records

    rows = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    standing = standing_records(rows)
    assert sorted(standing) == list(range(1, last_step + 1))
    trained = [i for row in standing.values() for i in row["prompts"]]
    state = json.loads((run_dir / f"global_step_{last_step}" / "trainer_state.json").read_text())[
        "extra_state"
    ]
    cursor_state, in_flight = state["data_cursor"], state["prompts_in_flight"]
    assert len(in_flight) == IN_FLIGHT - 8, state
    # The feeder's draws, replayed: 12 for the first step (its batch and the 4 extra groups), then a
    # batch of 8 a step (a resumed feeder enqueues its checkpoint's 12 first and draws nothing for
    # that step), until the cursor stands where the last checkpoint says. How many steps the first
    # run took before Ctrl-C stopped it varies, and the draws may run into later epochs.
    cursor = PromptCursor(
        cursor_state["num_items"],
        shuffle=cursor_state["shuffle"],
        seed=cursor_state["seed"],
        drop_last=cursor_state["drop_last"],
    )
    handed_out = cursor.next_indices(12)
    while (cursor.epoch, cursor.position) != (cursor_state["epoch"], cursor_state["position"]):
        assert len(handed_out) < 8 * (last_step + 2), f"the cursor never reached {cursor_state}"
        handed_out += cursor.next_indices(8)
    assert Counter(trained) + Counter(in_flight) == Counter(handed_out), (trained, in_flight, handed_out)
    steps = [r for r in read_rows(run_dir) if "training/global_step" in r]
    assert len(steps) >= last_step and {r["training/groups_in_flight"] for r in steps} == {IN_FLIGHT}


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_process_and_the_same_command_resumes(user, tmp_path):
    """And the run it resumes queues a step ahead, over-provisioned: no prompt skipped or doubled."""
    import signal

    from rlmesh.learner import latest_checkpoint
    from tests.support.processes import pid_alive

    run_dir = tmp_path / "interrupted"
    argv = [sys.executable, "-m", "rlmesh.cli", "train", "-c", str(user.config)]
    overrides = [f"trainer.default_local_dir={run_dir}", *AHEAD, "trainer.total_training_steps=500"]
    proc = subprocess.Popen(
        [*argv, *overrides],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # Ctrl-C once the second step is reported
        seen.append(line)
        if re.match(r"\[train\] step +2/500 ", line):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=180)
    stdout = "".join(seen) + out
    assert proc.returncode == 130, stdout[-3000:] + err[-3000:]
    pids = [int(p) for p in re.findall(r"\(pid (\d+)", stdout)]
    assert len(pids) == 6  # redis, reward, reference, rollout-0, learner, control
    assert not [p for p in pids if pid_alive(p)], "a process outlived rlmesh train's Ctrl-C"
    # The learner wrote its last step on the way out; the same command picks up from there.
    checkpoint = latest_checkpoint(str(run_dir))
    assert checkpoint is not None, stdout[-3000:]
    stopped_at = int(Path(checkpoint).name.rsplit("_", 1)[-1])
    assert stopped_at >= 2
    said = f"[train] last checkpoint: step {stopped_at} ({checkpoint}); running the same command again resumes from it"
    assert said in stdout.splitlines(), stdout[-3000:]
    # Six more steps: past the 64 prompts of the first epoch whenever the first run stopped (12 +
    # 8 a step), so the audit follows the cursor across an epoch's dropped tail.
    last = stopped_at + 6
    again = rlmesh_train(user.config, *overrides[:-1], f"trainer.total_training_steps={last}")
    summary = summary_of(again)
    assert f"[train] resumed from the checkpoint of step {stopped_at}\n" in again.stdout, again.stdout
    assert progress_steps(again) == [(step, last) for step in range(stopped_at + 1, last + 1)]
    assert summary["steps"] == last
    audit_prompts_of_an_ahead_run(run_dir, last)
