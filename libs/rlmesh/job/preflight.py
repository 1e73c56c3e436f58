"""Pre-flight: what a job would fail on after its services start (model, tokenizer, data, reward) and a
run that is already finished, found in seconds before anything starts. ``rlmesh config validate``
and ``rlmesh train`` run it; docs/train.md"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig
    from rlmesh.data import RLHFDataset

Progress = Callable[[str], None]

# The reward is called on this many rows of the training data, each with an empty response and
# with the row's ground truth as the response.
DRY_ROWS = 2
# A problem quotes this much of a library's exception: its first line, not a page of traceback.
MAX_REASON_CHARS = 300
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
# A Hugging Face Hub repo id ("org/name"): what transformers fetches when no such directory exists.
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class FinishedRun:
    """The checkpoint a run would resume from is at or past the run's last step."""

    checkpoint: str
    step: int
    total_steps: int
    why_total: str  # where total_steps comes from, in config keys
    resume_mode: str = "auto"

    def line(self) -> str:
        """One line: what was found and what to change to train anyway."""
        more = (
            "raise trainer.total_training_steps"
            if self.why_total.startswith("trainer.total_training_steps")
            else "raise trainer.total_epochs (or set trainer.total_training_steps)"
        )
        other = (
            "to start another run, set a new trainer.default_local_dir, or trainer.resume_mode=disable to "
            "start over"
            if self.resume_mode == "auto"
            else "to start over, set trainer.resume_mode=disable"
        )
        return (
            f"nothing to train: the checkpoint {self.checkpoint} is at step {self.step} and this run has "
            f"{self.total_steps} steps ({self.why_total}). To train more, {more}; {other}"
        )


@dataclass
class PreflightReport:
    """What the pre-flight found: ``problems`` stop a run (each names its file, row, key or line),
    ``notes`` do not; ``checked`` says what was looked at; ``finished`` when there is nothing to train."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    finished: FinishedRun | None = None


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    first = first if len(first) <= MAX_REASON_CHARS else first[: MAX_REASON_CHARS - 3] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _is_remote(path: str) -> bool:
    return "://" in path


def _hub_id(path: str) -> bool:
    """``path`` names no local directory and reads as a Hub repo id (whose first part is no local
    directory either: ``data/modle`` next to a ``data/`` folder is a typo, not a repo)."""
    local = Path(path).expanduser()
    return not local.exists() and bool(HUB_ID.match(path)) and not Path(path.split("/")[0]).is_dir()


def _calls(calls: list[tuple[str, int, str]], of: int) -> str:
    """Where dry calls of the reward were made: ``FILE, rows 0, 1, each with ...`` when they are all
    the calls (of ``of``) on one file, else each ``FILE, row N, with ...``."""
    files = {file for file, _, _ in calls}
    if len(calls) == of and len(files) == 1:
        rows = ", ".join(str(row) for row in sorted({row for _, row, _ in calls}))
        labels = " and with ".join(dict.fromkeys(label for _, _, label in calls))
        return f"{files.pop()}, rows {rows}, each with {labels}"
    return "; ".join(f"{file}, row {row}, with {label}" for file, row, label in calls)


class _Checks:
    """One pre-flight over one config; each ``check_*`` adds to ``report``."""

    def __init__(self, cfg: RLMeshConfig, progress: Progress) -> None:
        self.cfg = cfg
        self.say = progress
        self.report = PreflightReport()
        self.tokenizer: Any = None
        self.vocab_size: int | None = None
        self.datasets: dict[str, RLHFDataset] = {}
        self.missing: set[str] = set()  # directories already reported missing: once is enough

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def note(self, text: str) -> None:
        self.report.notes.append(text)

    # ---- model and tokenizer -------------------------------------------------------------------

    def model_config(self, key: str, path: str, trust_remote_code: bool) -> Any:
        """The HF config at ``path`` (``key`` names the setting), or None after a problem or a note."""
        # transformers (and torch with it) is imported only where there is a config to load.
        if _hub_id(path):
            from transformers import AutoConfig

            try:
                return AutoConfig.from_pretrained(
                    path, trust_remote_code=trust_remote_code, local_files_only=True
                )
            except Exception:
                self.note(
                    f"{key}={path}: no such directory here, nor in the Hugging Face cache: it is fetched from "
                    "the Hub when the job starts (not checked here)"
                )
                return None
        local = Path(path).expanduser()
        if not local.exists():
            self.problem(f"{key}={path}: no such directory")
            self.missing.add(path)
            return None
        if not local.is_dir():
            self.problem(
                f"{key}={path}: not a directory (an HF model directory with config.json is expected)"
            )
            return None
        if not (local / "config.json").is_file():
            names = sorted(p.name for p in local.iterdir())[:8]
            self.problem(
                f"{key}={path}: no config.json in it, so no HF model directory (it holds: "
                f"{', '.join(names) or 'nothing'})"
            )
            return None
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(local), trust_remote_code=trust_remote_code)
        except Exception as e:
            self.problem(f"{key}={path}: its config.json does not load: {_reason(e)}")
            return None
        if not any(any(local.glob(pattern)) for pattern in WEIGHT_PATTERNS):
            self.problem(f"{key}={path}: no weights in it (no {', '.join(WEIGHT_PATTERNS)} file)")
        return config

    def tokenizer_key(self) -> str:
        cfg = self.cfg
        if cfg.data.tokenizer:
            return "data.tokenizer"
        if cfg.actor_rollout_ref.model.tokenizer_path:
            return "actor_rollout_ref.model.tokenizer_path"
        return "actor_rollout_ref.model.path"

    def load_tokenizer(self, key: str, path: str, **kwargs: Any) -> Any:
        """The tokenizer at ``path`` as rlmesh loads it, or None after a problem or a note."""
        hub = _hub_id(path)
        local = Path(path).expanduser()
        if not hub and not local.is_dir():
            if path not in self.missing:
                what = "not a directory" if local.exists() else "no such directory"
                self.problem(f"{key}={path}: {what}, so no tokenizer")
            return None
        if not hub and not any((local / name).exists() for name in TOKENIZER_FILES):
            # transformers would make an empty tokenizer of the model's type from config.json alone.
            self.problem(
                f"{key}={path}: no tokenizer in it (none of {', '.join(TOKENIZER_FILES)}); set data.tokenizer "
                "to the tokenizer's directory"
            )
            return None
        from rlmesh.models.tokenizer import load_tokenizer

        try:
            return load_tokenizer(path, **kwargs, **({"local_files_only": True} if hub else {}))
        except Exception as e:
            if hub:
                self.note(
                    f"{key}={path}: the tokenizer is fetched from the Hub when the job starts (not checked here)"
                )
            else:
                self.problem(f"{key}={path}: the tokenizer does not load: {_reason(e)}")
            return None

    def check_models(self) -> None:
        cfg = self.cfg
        model = cfg.actor_rollout_ref.model
        self.say(f"loading the model's config and the tokenizer ({model.path})")
        config = self.model_config("actor_rollout_ref.model.path", model.path, bool(model.trust_remote_code))
        if config is not None:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            self.vocab_size = getattr(text, "vocab_size", None)
            self.report.checked.append(
                f"model: {model.path} ({config.model_type}, vocab_size {self.vocab_size})"
            )
            positions = getattr(text, "max_position_embeddings", None)
            longest = cfg.data.max_prompt_length + cfg.data.max_response_length
            if positions is not None and longest > positions:
                self.note(
                    f"data.max_prompt_length + data.max_response_length = {longest} tokens is more than the "
                    f"model's max_position_embeddings ({positions}, {model.path}/config.json)"
                )
        key, path = self.tokenizer_key(), cfg.tokenizer_path()
        self.tokenizer = self.load_tokenizer(key, path, chat_template=model.custom_chat_template)
        if self.tokenizer is not None:
            template = (
                "custom_chat_template" if model.custom_chat_template
                else "its own chat template" if getattr(self.tokenizer, "chat_template", None)
                else "no chat template"
            )  # fmt: skip
            self.report.checked.append(f"tokenizer: {path} ({len(self.tokenizer)} tokens, {template})")
            self.check_special_ids(key, path)
        if cfg.uses_critic():
            critic = cfg.critic.model
            # As the learner reads it: the schema's default critic path stands for the actor's.
            critic_path = (
                model.path if critic.path == type(critic).model_fields["path"].default else critic.path
            )
            if critic_path != model.path:
                self.model_config("critic.model.path", critic_path, bool(critic.trust_remote_code))

    def check_special_ids(self, key: str, path: str) -> None:
        if self.vocab_size is None:
            return
        tok = self.tokenizer
        for name in ("eos_token_id", "pad_token_id"):
            value = getattr(tok, name, None)
            if isinstance(value, int) and value >= self.vocab_size:
                self.problem(
                    f"{key}={path}: the tokenizer's {name} is {value}, not below the model's vocab_size "
                    f"{self.vocab_size} (actor_rollout_ref.model.path={self.cfg.actor_rollout_ref.model.path}): "
                    "the tokenizer is not this model's"
                )

    # ---- data ------------------------------------------------------------------------------------

    def check_data(self, split: str) -> None:
        from rlmesh.data import DatasetError, RLHFDataset

        key = f"data.{split}_files"
        files = getattr(self.cfg.data, f"{split}_files")
        files = [files] if isinstance(files, str) else list(files)
        self.say(f"reading {key} ({', '.join(map(str, files))})")
        missing = [f for f in files if not _is_remote(f) and not Path(f).expanduser().exists()]
        for f in missing:
            self.problem(f"{key}: {f}: no such file")
        if missing or self.tokenizer is None:
            return
        try:
            dataset = RLHFDataset.from_config(self.cfg.data, self.tokenizer, split=split)
        except DatasetError as e:
            self.problem(f"{key}: {e}")
            self.datasets_despite(split)
            return
        except Exception as e:  # the tokenizer failing on the prompts: the learner would fail alike
            self.problem(f"{key}: tokenizing the prompts failed: {_reason(e)}")
            return
        self.datasets[split] = dataset
        self.report.checked.append(
            f"{key}: {len(dataset)} prompts from {len(dataset.files)} file(s), the longest "
            f"{max(len(item.prompt_ids) for item in dataset.items)} tokens"
        )
        if dataset.num_filtered:
            self.note(
                f"{key}: {dataset.overlong_summary()}; they are left out "
                f"({dataset.setting('filter_overlong_prompts')}=true)"
            )
        elif dataset.num_truncated:
            self.note(
                f"{key}: {dataset.overlong_summary()}; they will be truncated "
                f"({dataset.setting('truncation')}={dataset.truncation})"
            )
        self.check_token_ids(key, dataset)

    def datasets_despite(self, split: str) -> None:
        """After a problem with the data: the dataset with its overlong prompts cut, when that was the
        problem, so that the checks after it (the reward's) still run and report theirs."""
        from rlmesh.data import DatasetError, RLHFDataset

        data = self.cfg.data
        if data.truncation != "error" or data.filter_overlong_prompts:
            return
        try:
            self.datasets[split] = RLHFDataset.from_config(
                data, self.tokenizer, split=split, truncation="left"
            )
        except DatasetError:
            return  # another problem with the data than the prompts' length: reported already

    def check_token_ids(self, key: str, dataset: RLHFDataset) -> None:
        empty = [item for item in dataset.items if not item.prompt_ids]
        if empty:
            self.problem(
                f"{key}: {empty[0].file}, row {empty[0].row}: the prompt is no tokens at all ({len(empty)} "
                f"prompts are none): the tokenizer ({self.tokenizer_key()}={self.cfg.tokenizer_path()}) does "
                "not fit the data"
            )
        if self.vocab_size is None:
            return
        beyond = [
            item for item in dataset.items if item.prompt_ids and max(item.prompt_ids) >= self.vocab_size
        ]
        if beyond:
            first = beyond[0]
            self.problem(
                f"{key}: {first.file}, row {first.row}: token id {max(first.prompt_ids)} is not below the model's "
                f"vocab_size {self.vocab_size} ({len(beyond)} prompts have such ids): the tokenizer "
                f"({self.tokenizer_key()}={self.cfg.tokenizer_path()}) is not the model's "
                f"(actor_rollout_ref.model.path={self.cfg.actor_rollout_ref.model.path})"
            )

    # ---- reward ------------------------------------------------------------------------------------

    def check_reward(self) -> None:
        from rlmesh.reward.function_loader import RewardFunctionLoadError, configured_function
        from rlmesh.reward.managers import reward_manager_from_config

        cfg = self.cfg
        section = cfg.rlmesh.reward
        if section.addresses:
            self.note(
                f"the reward service at {', '.join(section.addresses)} (rlmesh.reward.addresses) scores: "
                "its reward function is not checked here"
            )
            return
        if cfg.reward_model.enable:
            rm = cfg.reward_model.model
            self.say(f"loading the reward model's config and tokenizer ({rm.path})")
            config = self.model_config("reward_model.model.path", rm.path, rm.trust_remote_code)
            if config is not None:
                self.load_tokenizer(
                    "reward_model.model.path", rm.path, trust_remote_code=rm.trust_remote_code
                )
                self.report.checked.append(f"reward: the reward model {rm.path} ({config.model_type})")
            return
        self.say("loading the reward function")
        try:
            function = configured_function(cfg.custom_reward_function, section.function)
            manager = reward_manager_from_config(cfg)
        except RewardFunctionLoadError as e:
            self.problem(str(e))
            return
        name = function.name if function is not None else "the built-in each data_source picks"
        if function is None and not self.check_data_sources():
            return
        split = next((s for s in ("train", "val") if s in self.datasets), None)
        if split is None:
            self.report.checked.append(f"reward: {name} (not called: no data to call it on)")
            return
        self.report.checked.append(f"reward: {name}; {self.dry_call(function, manager, split)}")

    def check_data_sources(self) -> bool:
        """Without a reward function, every data_source needs a built-in rule; False after a problem."""
        from rlmesh.reward.builtin import builtin_for, data_source_rules

        ok = True
        for split, dataset in self.datasets.items():
            unknown: dict[str, list[Any]] = {}
            for item in dataset.items:
                if builtin_for(item.data_source) is None:
                    unknown.setdefault(item.data_source, []).append(item)
            for source, items in unknown.items():
                ok = False
                self.problem(
                    f"data.{split}_files: {items[0].file}, row {items[0].row} (and {len(items) - 1} more rows): "
                    f"no built-in reward for data_source {source!r} (column {dataset.setting('reward_fn_key')}"
                    f"={dataset.reward_fn_key}); the built-ins: {', '.join(data_source_rules())}. Set "
                    "custom_reward_function.path to a file with your compute_score(data_source, solution_str, "
                    "ground_truth, extra_info), or rlmesh.reward.function to a built-in"
                )
        return ok

    def dry_call(self, function: Any, manager: Any, split: str) -> str:
        """Scores the first rows with an empty response and with their ground truth, as the reward
        service does (its scorer: the per-sample deadline, the score parser, the user's file and line
        of an exception); returns what it scored."""
        from rlmesh.reward.scorer import RewardScorer
        from rlmesh.v1 import reward_pb2

        section = self.cfg.rlmesh.reward
        timeout_s = section.function_timeout_s or section.timeout_s
        items = self.datasets[split].items[:DRY_ROWS]
        self.say(f"calling the reward function on {len(items)} rows (each within {timeout_s:g} s)")
        samples, calls = [], []
        for item in items:
            for label, response in (
                ("an empty response", ""),
                ("its ground truth as the response", item.ground_truth),
            ):
                samples.append(
                    reward_pb2.RewardSample(
                        uid=f"preflight-{len(samples)}",
                        prompt_text=item.prompt_text,
                        prompt_ids=item.prompt_ids,
                        response_text=str(response),
                        ground_truth=str(item.ground_truth),
                        data_source=item.data_source,
                        extra_info_json=json.dumps(item.extra_info, default=str),
                    )
                )
                calls.append((item.file, item.row, label))
        scorer = RewardScorer(function, timeout_s=timeout_s, max_workers=len(samples), manager=manager)
        quiet = logging.getLogger("rlmesh.reward")  # its per-call warning: the problems below say it
        was_disabled, quiet.disabled = quiet.disabled, True
        try:
            results = asyncio.run(scorer.score(samples))
        finally:
            quiet.disabled = was_disabled
            scorer.close()
        scores, failed = [], {}
        for sample, call, result in zip(samples, calls, results, strict=True):
            if result.HasField("error"):
                prefix = f"sample uid={sample.uid!r} data_source={sample.data_source!r}: "
                failed.setdefault(result.error.message.removeprefix(prefix), []).append(call)
            else:
                scores.append(f"{result.score:g}")
        for message, where in failed.items():  # one problem per distinct failure, not per call
            self.problem(f"the reward called on data.{split}_files: {_calls(where, len(calls))}: {message}")
        return f"called on {len(items)} rows (empty response, ground truth): scores {', '.join(scores) or 'none'}"

    # ---- a finished run ------------------------------------------------------------------------

    def check_finished(self) -> None:
        trainer = self.cfg.trainer
        # val_only validates the resumed policy and trains nothing whatever its step.
        if trainer.val_only or trainer.resume_mode == "disable":
            return
        if trainer.resume_mode == "auto":
            # As the learner looks for it (trainer.default_local_dir as given).
            root = Path(trainer.default_local_dir)
            if not root.is_dir():
                self.report.checked.append(f"resume: nothing in {root}, the run starts at step 0")
                return
            self.say(f"looking for a checkpoint in {root}")
            from rlmesh.learner.checkpoints.store import latest_checkpoint

            path = latest_checkpoint(root)
            if path is None:
                self.report.checked.append(
                    f"resume: no complete checkpoint in {root}, the run starts at step 0"
                )
                return
        else:
            from rlmesh.learner.checkpoints.store import is_complete

            path = str(trainer.resume_from_path)
            if not is_complete(path):
                self.problem(
                    f"trainer.resume_from_path={path}: not a complete checkpoint (no such directory, or no "
                    "COMPLETE marker in it); the learner cannot resume from it"
                )
                return
        step = self.checkpoint_step(path)
        if step is None:
            return
        total, why = self.total_steps()
        if total is None:
            return
        self.report.checked.append(f"resume: from {path} at step {step} of {total}")
        if step >= total:
            self.report.finished = FinishedRun(path, step, total, why, trainer.resume_mode)

    def checkpoint_step(self, path: str) -> int | None:
        from rlmesh.learner.checkpoints.store import checkpoint_step

        try:
            return checkpoint_step(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.problem(
                f"{Path(path) / 'trainer_state.json'}: the step of the checkpoint to resume does not read ({_reason(e)}); the learner "
                "cannot resume from it: move it away, or set trainer.resume_mode=disable"
            )
            return None

    def total_steps(self) -> tuple[int | None, str]:
        """The run's steps as the learner counts them, and why; None without the training set."""
        trainer = self.cfg.trainer
        train = self.datasets.get("train")
        if not trainer.total_training_steps and train is None:
            return None, ""
        from rlmesh.data.cursor import total_training_steps

        total = total_training_steps(self.cfg, len(train) if train is not None else 0)
        if trainer.total_training_steps:
            return total, f"trainer.total_training_steps={trainer.total_training_steps}"
        return total, (
            f"trainer.total_epochs={trainer.total_epochs} x {len(train) if train else 0} prompts / "
            f"data.train_batch_size={self.cfg.data.train_batch_size}"
        )


def run_preflight(cfg: RLMeshConfig, progress: Progress | None = None) -> PreflightReport:
    """Checks what ``cfg`` names: the model's config and the tokenizer load, the data reads and fits,
    the reward loads and scores the first rows, and whether the run is already finished. Loads no
    weights, starts nothing, makes nothing in the run's directory. ``progress`` is told each step as
    it starts. Calls ``asyncio.run``: not from a running event loop."""
    checks = _Checks(cfg, progress or (lambda message: None))
    if cfg.trainer.total_training_steps:
        # The run's length needs no data: a finished run is told at once, nothing else loaded.
        checks.check_finished()
        if checks.report.finished is not None:
            return checks.report
    checks.check_models()
    checks.check_data("train")
    if cfg.data.val_files:
        checks.check_data("val")
    checks.check_reward()
    if not cfg.trainer.total_training_steps:
        checks.check_finished()
    return checks.report


def format_problems(report: PreflightReport) -> str:
    """Every problem as a ``- `` item, a problem's further lines (a traceback's frames) indented."""
    return "\n".join("  - " + problem.replace("\n", "\n    ") for problem in report.problems)
