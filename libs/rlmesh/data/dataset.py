"""Prompts from Parquet in verl's layout, tokenized the way verl's RLHFDataset does it.

docs/train.md#data-layout"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmesh.data.errors import DatasetError

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right", "middle")
# An overlong-prompt message names this many rows (and the longest): enough to find them.
SHOWN_ROWS = 5
# The settings a message names, as the caller's users spell them (from_config: data.<name>).
SETTINGS = ("prompt_key", "reward_fn_key", "max_prompt_length", "truncation", "filter_overlong_prompts")


@dataclass(frozen=True)
class PromptItem:
    """One tokenized prompt. ``index`` is its position in the dataset (what a sampler hands out);
    ``file`` and ``row`` say where it came from."""

    index: int
    prompt_ids: list[int]
    prompt_text: str  # the text prompt_ids decode to (chat template applied, after truncation)
    ground_truth: Any  # reward_model.ground_truth as stored (usually a string); None if absent
    data_source: str
    ability: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    row: int = 0
    file: str = ""
    raw_prompt: list[dict[str, Any]] | str = ""  # the prompt column as read, before templating


@dataclass(frozen=True)
class Overlong:
    """A prompt longer than max_prompt_length: where it is and its length in tokens."""

    file: str
    row: int
    tokens: int


def read_parquet(path: str | Path) -> pa.Table:
    """The whole table, or a DatasetError naming the file."""
    # Imported here: pyarrow starts allocator threads, and the fork server imports this module.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(path))
    except FileNotFoundError:
        raise DatasetError("no such file", file=path) from None
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"cannot read it as Parquet: {e}", file=path) from e


def truncate_ids(ids: list[int], max_length: int, truncation: str) -> list[int]:
    """Cut ids to max_length the way verl does (left/right/middle); "error" is the caller's job."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "middle":
        left = max_length // 2
        right = max_length - left
        return ids[:left] + ids[len(ids) - right :]
    raise ValueError(f"truncation must be one of {TRUNCATIONS} here, got {truncation!r}")


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    # Duck-typed: a pydantic section, an OmegaConf node, a SimpleNamespace or a plain dict.
    value = cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)
    return default if value is None else value


def _as_file_list(files: str | Path | list[str | Path] | tuple[str | Path, ...]) -> list[str]:
    if isinstance(files, str | Path):
        files = [files]
    out = [os.path.expanduser(str(f)) for f in files]  # verl's defaults are "~/data/..."
    if not out:
        raise DatasetError("no data files given")
    return out


class RLHFDataset:
    """Tokenized prompts from one or more verl-layout Parquet files (concatenated in order).

    ``setting_names`` says how the caller's users spell the settings its messages name
    (``max_prompt_length``, ``truncation``, ...): ``from_config`` gives ``data.<name>``, a command
    line its option names (``""``: one it does not offer, left out of a hint); a setting not in it
    is named as the argument is."""

    def __init__(
        self,
        files: str | Path | list[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        require_ground_truth: bool = True,
        reward_fn_key: str = "data_source",
        max_samples: int = -1,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        setting_names: Mapping[str, str] | None = None,
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be > 0, got {max_prompt_length}")
        self.files = _as_file_list(files)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.require_ground_truth = require_ground_truth
        self.reward_fn_key = reward_fn_key
        self.max_samples = max_samples
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.setting_names = dict(setting_names or {})

        self.items: list[PromptItem] = []
        self.num_rows = 0  # rows read (after max_samples, before filtering)
        self.num_filtered = 0  # rows dropped by filter_overlong_prompts
        self.num_truncated = 0  # rows cut by truncation
        self.overlong: list[Overlong] = []  # every prompt over max_prompt_length, in order
        for path in self.files:
            if 0 <= max_samples <= self.num_rows:
                break
            self._load_file(path)
        if self.num_rows == 0:
            raise DatasetError("the dataset has no rows", file=", ".join(self.files))
        if self.overlong and truncation == "error" and not filter_overlong_prompts:
            # Every row is counted before this fails: one run of the check says how many to fix.
            raise DatasetError(
                f"{self.overlong_summary()}. {self._overlong_remedies()}",
                file=self._overlong_file(),
                row=self.overlong[0].row if len(self.overlong) == 1 else None,
                column=prompt_key,
            )
        if self.filter_overlong_prompts:
            logger.info(
                "%s: filtered out %d of %d prompts longer than %s=%d; %d left",
                ", ".join(self.files), self.num_filtered, self.num_rows, self.setting("max_prompt_length"),
                max_prompt_length, len(self.items),
            )  # fmt: skip
        elif self.num_truncated:
            logger.info(
                "%s: %s; they are cut (%s=%s)",
                ", ".join(self.files), self.overlong_summary(), self.setting("truncation"), truncation,
            )  # fmt: skip
        if not self.items:
            raise DatasetError(
                f"all {self.num_rows} prompts are longer than {self.setting('max_prompt_length')}="
                f"{max_prompt_length} and were filtered out ({self.setting('filter_overlong_prompts')})",
                file=", ".join(self.files),
            )
        logger.info("dataset %s: %d prompts", ", ".join(self.files), len(self.items))

    def setting(self, name: str) -> str:
        """``name`` (a constructor argument) as the caller's users spell it."""
        return self.setting_names.get(name, name)

    def _overlong_remedies(self) -> str:
        # Only the settings the caller offers (a name of "" is one it does not).
        remedies = [f"raise {self.setting('max_prompt_length')}"]
        if self.setting("truncation"):
            remedies.append(f"set {self.setting('truncation')} to left, right or middle")
        if self.setting("filter_overlong_prompts"):
            remedies.append(f"set {self.setting('filter_overlong_prompts')}=true to drop them")
        text = ", ".join(remedies[:-1]) + (", or " if len(remedies) > 1 else "") + remedies[-1]
        return text[0].upper() + text[1:]

    def _overlong_file(self) -> str | None:
        files = {o.file for o in self.overlong}
        return next(iter(files)) if len(files) == 1 else None

    def overlong_summary(self) -> str:
        """How many prompts are over max_prompt_length, a few of their rows and the longest; empty
        when none is. The rows carry their file's name when they are in several files."""
        if not self.overlong:
            return ""
        one_file = self._overlong_file() is not None

        def where(o: Overlong) -> str:
            return f"row {o.row}" if one_file else f"{o.file} row {o.row}"

        shown = [f"{where(o)} ({o.tokens} tokens)" for o in self.overlong[:SHOWN_ROWS]]
        more = len(self.overlong) - len(shown)
        longest = max(self.overlong, key=lambda o: o.tokens)
        text = (
            f"{len(self.overlong)} of {self.num_rows} prompts are longer than "
            f"{self.setting('max_prompt_length')}={self.max_prompt_length} tokens: "
            + ", ".join(shown)
            + (f" and {more} more" if more else "")
        )
        if more:  # else it is among those shown
            text += f"; the longest is {where(longest)} ({longest.tokens} tokens)"
        return text

    @classmethod
    def from_config(
        cls, data_cfg: Any, tokenizer: Any, split: str = "train", **overrides: Any
    ) -> RLHFDataset:
        """Build from a config section with verl's ``data.*`` key names (read as attributes or
        mapping keys): ``{split}_files``, ``prompt_key``, ``max_prompt_length``, ``truncation``,
        ``filter_overlong_prompts``, ``reward_fn_key``, ``{split}_max_samples``,
        ``apply_chat_template_kwargs``. ``overrides`` win over the config."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        files = _cfg_get(data_cfg, f"{split}_files")
        if not files:
            raise DatasetError(f"data.{split}_files is not set")
        if not isinstance(files, str | Path):
            files = list(files)  # e.g. an OmegaConf ListConfig
        kwargs: dict[str, Any] = {
            "prompt_key": _cfg_get(data_cfg, "prompt_key", "prompt"),
            "max_prompt_length": int(_cfg_get(data_cfg, "max_prompt_length", 512)),
            "truncation": _cfg_get(data_cfg, "truncation", "error"),
            "filter_overlong_prompts": bool(_cfg_get(data_cfg, "filter_overlong_prompts", False)),
            "reward_fn_key": _cfg_get(data_cfg, "reward_fn_key", "data_source"),
            "max_samples": int(_cfg_get(data_cfg, f"{split}_max_samples", -1)),
            "chat_template_kwargs": dict(_cfg_get(data_cfg, "apply_chat_template_kwargs", {})),
        }
        kwargs.update(overrides)
        kwargs.setdefault("setting_names", {name: f"data.{name}" for name in SETTINGS})
        return cls(files, tokenizer, **kwargs)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    # ---- reading -------------------------------------------------------------------------------

    def _load_file(self, path: str) -> None:
        table = read_parquet(path)
        required = [self.prompt_key, self.reward_fn_key]
        if self.require_ground_truth:
            required.append("reward_model")
        needed_for = {
            self.prompt_key: f"the prompts ({self.setting('prompt_key')})",
            self.reward_fn_key: f"the reward function's data_source ({self.setting('reward_fn_key')})",
            "reward_model": "each row's {style, ground_truth} for the reward function",
        }
        for name in required:
            if name not in table.column_names:
                raise DatasetError(
                    f"missing column, which holds {needed_for[name]} (the file has: "
                    f"{', '.join(table.column_names) or 'none'})",
                    file=path,
                    column=name,
                )
        n = table.num_rows
        if n == 0:
            raise DatasetError("the file has no rows", file=path)
        if self.max_samples >= 0:
            n = min(n, self.max_samples - self.num_rows)

        def column(name: str) -> list[Any]:
            if name not in table.column_names:
                return [None] * n
            return table.column(name).slice(0, n).to_pylist()

        prompts, sources = column(self.prompt_key), column(self.reward_fn_key)
        abilities, rewards, extras = column("ability"), column("reward_model"), column("extra_info")
        rows = [
            self._check_row(path, i, prompts[i], sources[i], abilities[i], rewards[i], extras[i])
            for i in range(n)
        ]
        texts = [self._prompt_text(path, i, r["raw_prompt"]) for i, r in enumerate(rows)]
        all_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        self.num_rows += n

        for i, (row, text, ids) in enumerate(zip(rows, texts, all_ids, strict=True)):
            ids = list(ids)
            if len(ids) > self.max_prompt_length:
                self.overlong.append(Overlong(path, i, len(ids)))
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.truncation == "error":
                    continue  # __init__ raises once every file is counted
                ids = truncate_ids(ids, self.max_prompt_length, self.truncation)
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
                self.num_truncated += 1
            self.items.append(
                PromptItem(index=len(self.items), prompt_ids=ids, prompt_text=text, row=i, file=path, **row)
            )

    def _check_row(
        self, path: str, i: int, prompt: Any, source: Any, ability: Any, reward: Any, extra: Any
    ) -> dict[str, Any]:
        def bad(column: str, problem: str) -> DatasetError:
            return DatasetError(problem, file=path, row=i, column=column)

        if isinstance(prompt, str):
            if not prompt:
                raise bad(self.prompt_key, "empty prompt")
        elif isinstance(prompt, list):
            if not prompt:
                raise bad(self.prompt_key, "empty message list")
            messages = []
            for j, m in enumerate(prompt):
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                ):
                    raise bad(
                        self.prompt_key, f"message {j} is not a {{role: str, content: str}} dict: {m!r}"
                    )
                # Parquet structs give every message every key seen in the column; drop the Nones.
                messages.append({k: v for k, v in m.items() if v is not None})
            prompt = messages
        else:
            raise bad(
                self.prompt_key, f"expected a chat-message list or a string, got {type(prompt).__name__}"
            )
        if not isinstance(source, str):
            raise bad(self.reward_fn_key, f"expected a string, got {type(source).__name__}")
        if ability is not None and not isinstance(ability, str):
            raise bad("ability", f"expected a string, got {type(ability).__name__}")
        if reward is not None and not isinstance(reward, dict):
            raise bad(
                "reward_model", f"expected a {{style, ground_truth}} struct, got {type(reward).__name__}"
            )
        ground_truth = (reward or {}).get("ground_truth")
        if ground_truth is None and self.require_ground_truth:
            raise bad("reward_model.ground_truth", "missing ground truth (needed by the reward function)")
        if extra is not None and not isinstance(extra, dict):
            raise bad("extra_info", f"expected a struct, got {type(extra).__name__}")
        return {
            "raw_prompt": prompt,
            "data_source": source,
            "ability": ability or "",
            "ground_truth": ground_truth,
            "extra_info": extra or {},
        }

    def _prompt_text(self, path: str, i: int, prompt: list[dict[str, Any]] | str) -> str:
        if isinstance(prompt, str):
            return prompt
        if not self.use_chat_template:
            # A base tokenizer without a template: the message contents, one per line.
            return "\n".join(m["content"] for m in prompt)
        try:
            return self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        except Exception as e:  # a template that rejects the messages (roles, order, ...)
            raise DatasetError(f"chat template failed: {e}", file=path, row=i, column=self.prompt_key) from e
