"""Structured logging: one JSON object per line with the service name and run id on every record."""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD_ATTRS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, run_id: str | None) -> None:
        super().__init__()
        self.service = service
        self.run_id = run_id

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "run_id": self.run_id,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Fields passed with `extra={...}` become top-level keys.
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str, run_id: str | None) -> None:
        super().__init__(
            f"%(asctime)s %(levelname)s [{service}{'/' + run_id if run_id else ''}] %(name)s: %(message)s"
        )


def configure_logging(
    service: str, run_id: str | None = None, level: str = "INFO", fmt: str = "json"
) -> None:
    """Routes every logger of the process to stderr in the chosen format (``json`` or ``text``)."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, run_id) if fmt == "json" else TextFormatter(service, run_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc and asyncio are chatty at INFO about things that are not ours.
    for noisy in ("grpc", "asyncio", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
