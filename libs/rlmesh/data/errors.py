"""The one error type for bad data: it says where (file, row or line, column) and what."""

from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    """Bad input data. The message reads ``FILE, row N, column 'C': problem`` (``line N`` and
    ``field`` for JSON-lines input); the parts are kept as attributes for callers."""

    def __init__(
        self,
        problem: str,
        *,
        file: str | Path | None = None,
        row: int | None = None,
        column: str | None = None,
        line: int | None = None,
    ) -> None:
        self.problem, self.file, self.row, self.column, self.line = problem, file, row, column, line
        where = []
        if file is not None:
            where.append(str(file))
        if line is not None:
            where.append(f"line {line}")
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"{'field' if line is not None else 'column'} {column!r}")
        super().__init__(f"{', '.join(where)}: {problem}" if where else problem)
