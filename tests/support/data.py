"""Small verl-layout Parquet fixtures written by the tests themselves."""

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
