"""Prompt data the tests make themselves: verl-layout Parquet rows and files, and PromptItems as a
dataset hands them out."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq


def row(content, gt="1", source="test/src", **extra_cols):
    r = {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}] if isinstance(content, str) else content,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"index": 0},
    }
    r.update(extra_cols)
    return r


def write(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return path


def prompt_items(count: int) -> list:
    """``count`` one-token prompts (index i holds token i + 1), as a dataset hands them out."""
    from rlmesh.data import PromptItem

    return [
        PromptItem(
            index=i,
            prompt_ids=[i + 1],
            prompt_text=f"p{i}",
            ground_truth=str(i),
            data_source="arithmetic",
            ability="math",
            row=i,
            file="mem",
            raw_prompt=f"p{i}",
        )
        for i in range(count)
    ]
