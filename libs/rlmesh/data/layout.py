"""verl's dataset layout: the columns every rlmesh/verl RL Parquet file has, and a writer."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

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


T = TypeVar("T", bound=Hashable)


def distinct_splits(
    draw: Callable[[], T], *, train_size: int, val_size: int, dev_size: int, too_few: str
) -> dict[str, list[T]]:
    """``draw()`` until there are train + val + dev distinct items, split in the order drawn: the
    first ``val_size`` are "test", the next ``dev_size`` "dev", the rest "train" (so one seed's test
    split does not change with the train size). ValueError ``too_few`` when distinct items run out."""
    total = train_size + val_size + dev_size
    seen: set[T] = set()
    order: list[T] = []
    attempts = 0
    while len(order) < total:
        attempts += 1
        if attempts > 100 * total + 10_000:  # only with knobs that allow few distinct items
            raise ValueError(too_few)
        item = draw()
        if item not in seen:
            seen.add(item)
            order.append(item)
    return {
        "test": order[:val_size],
        "dev": order[val_size : val_size + dev_size],
        "train": order[val_size + dev_size :],
    }
