"""Datasets in verl's Parquet layout, the training cursor, and task generators."""

from rlmesh.data.arithmetic import (
    ARITHMETIC_DATA_SOURCE,
    ARITHMETIC_INSTRUCTION,
    evaluate_expression,
    format_arithmetic_solution,
    generate_arithmetic,
    make_arithmetic_rows,
)
from rlmesh.data.chain import CHAIN_DATA_SOURCE, generate_chain, make_chain_rows, response_lengths
from rlmesh.data.cursor import PromptCursor, iter_batches
from rlmesh.data.dataset import PromptItem, RLHFDataset, read_parquet, truncate_ids
from rlmesh.data.errors import DatasetError
from rlmesh.data.gsm8k import GSM8K_DATA_SOURCE, GSM8K_INSTRUCTION, convert_gsm8k, extract_gsm8k_solution

__all__ = [
    "ARITHMETIC_DATA_SOURCE",
    "ARITHMETIC_INSTRUCTION",
    "CHAIN_DATA_SOURCE",
    "GSM8K_DATA_SOURCE",
    "GSM8K_INSTRUCTION",
    "DatasetError",
    "PromptCursor",
    "PromptItem",
    "RLHFDataset",
    "convert_gsm8k",
    "evaluate_expression",
    "extract_gsm8k_solution",
    "format_arithmetic_solution",
    "generate_arithmetic",
    "generate_chain",
    "iter_batches",
    "make_arithmetic_rows",
    "make_chain_rows",
    "read_parquet",
    "response_lengths",
    "truncate_ids",
]
