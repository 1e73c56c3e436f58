"""CPU affinity for a service's processes (``rlmesh.<service>.cpus``), so that generation and
training on a small machine do not take turns on the same cores. docs/throughput.md#cpu-placement"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rlmesh.runtime")


def parse_cpus(spec: str, where: str) -> set[int]:
    """``"0"``, ``"1-3"``, ``"0,2-3"`` → the set of core ids; ValueError naming ``where``."""
    cores: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{where}={spec!r}: expected core ids like '0', '1-3' or '0,2-3'")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{where}={spec!r}: the range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    return cores


def apply_cpu_affinity(spec: str, where: str) -> set[int] | None:
    """Pins this process (and the threads and processes it starts afterwards) to the cores of
    ``spec``; an empty spec leaves it alone. ValueError, naming ``where``, for a malformed spec or
    cores this machine does not let the process use."""
    if not spec.strip():
        return None
    cores = parse_cpus(spec, where)
    allowed = os.sched_getaffinity(0)
    missing = sorted(cores - allowed)
    if missing:
        raise ValueError(
            f"{where}={spec!r}: core(s) {missing} are not available here (this process may use {sorted(allowed)})"
        )
    os.sched_setaffinity(0, cores)
    log.info("pinned to cores %s (%s)", sorted(cores), where)
    return cores
