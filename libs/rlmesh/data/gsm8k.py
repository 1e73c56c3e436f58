"""GSM8K (``question``, ``answer`` records) to verl's layout, as verl's GSM8K preprocessing does it.

docs/train.md#rlmesh-data"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlmesh.data.dataset import read_parquet
from rlmesh.data.errors import DatasetError
from rlmesh.data.layout import verl_row, write_rows

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's extract_solution pattern


def extract_gsm8k_solution(answer: str) -> str | None:
    """The final answer after ``#### `` with commas removed, or None when there is none."""
    m = _SOLUTION.search(answer)
    return None if m is None else m.group(1).replace(",", "")


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row (raises ValueError when the answer has no ``#### <number>``)."""
    solution = extract_gsm8k_solution(answer)
    if solution is None:
        raise ValueError('no final answer after "#### "')
    extra = {"split": split, "index": index, "answer": answer, "question": question}
    return verl_row(GSM8K_DATA_SOURCE, question + " " + GSM8K_INSTRUCTION, solution, extra)


def read_records(path: str | Path) -> Iterator[tuple[dict[str, int], Any]]:
    """(location, record) pairs: location is {"line": n} (1-based) for jsonl, {"row": i} for Parquet."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DatasetError(f"cannot read it: {e}", file=path) from None
    if magic == b"PAR1":
        for i, rec in enumerate(read_parquet(path).to_pylist()):
            yield {"row": i}, rec
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"neither Parquet nor UTF-8 JSON lines: {e}", file=path) from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield {"line": n}, json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"not valid JSON: {e}", file=path, line=n) from None


def convert_gsm8k(input_path: str | Path, out_dir: str | Path, split: str = "train") -> tuple[Path, int]:
    """Convert one GSM8K split; writes out_dir/{split}.parquet. Returns (path, rows written)."""
    rows = []
    for where, rec in read_records(input_path):
        if not isinstance(rec, dict):
            raise DatasetError(
                f"expected an object with question and answer, got {type(rec).__name__}",
                file=input_path,
                **where,
            )
        for key in ("question", "answer"):
            if not isinstance(rec.get(key), str):
                problem = (
                    "missing" if rec.get(key) is None else f"expected a string, got {type(rec[key]).__name__}"
                )
                raise DatasetError(problem, file=input_path, column=key, **where)
        try:
            rows.append(gsm8k_row(rec["question"], rec["answer"], split, len(rows)))
        except ValueError as e:
            raise DatasetError(str(e), file=input_path, column="answer", **where) from None
    if not rows:
        raise DatasetError("no records", file=input_path)
    return write_rows(rows, Path(out_dir) / f"{split}.parquet"), len(rows)
