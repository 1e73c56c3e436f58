"""verl's dataset layout: the columns every rlmesh/verl RL Parquet file has, and a writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def verl_row(
    data_source: str, content: str, ground_truth: str, extra_info: dict[str, Any], ability: str = "math"
) -> dict[str, Any]:
    """One row: a single user message as the prompt, a rule-style reward with its ground truth."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows (dicts with COLUMNS) to one Parquet file, creating its folder."""
    import pyarrow as pa  # here: pyarrow starts allocator threads, and the fork server imports this
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{c: r[c] for c in COLUMNS} for r in rows])
    pq.write_table(table, str(path))
    return path
