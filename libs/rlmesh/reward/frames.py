"""Where a reward function's exception came from: the user's file and line, and the last frames of
its traceback, so that a failure read in the learner's message points at the user's code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import traceback
from pathlib import Path

from rlmesh.reward.pool import Aborted

# The scorer's own frames and the thread and event-loop machinery a call runs under: never where a
# user's reward went wrong, and they would push the user's frames out of the few shown.
_OWN_FILES = frozenset(
    str(Path(__file__).with_name(n)) for n in ("pool.py", "function_loader.py", "scorer.py")
)
_MACHINERY_DIRS = (str(Path(asyncio.__file__).parent), str(Path(concurrent.futures.__file__).parent))
_THREADING = str(Path(threading.__file__))
# A message or a source line is quoted this far: enough to recognise it, not a tensor's repr.
MAX_MESSAGE_CHARS = 500
MAX_LINE_CHARS = 160
SHOWN_FRAMES = 3


def _machinery(filename: str) -> bool:
    return filename in _OWN_FILES or filename == _THREADING or filename.startswith(_MACHINERY_DIRS)


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def user_frames(exc: BaseException, own_file: str | None) -> list[traceback.FrameSummary]:
    """The frames of ``exc``'s traceback from the first one in ``own_file`` (the reward function's
    file; all of them when none is), without the scorer's and the thread pool's."""
    original = exc.original if isinstance(exc, Aborted) else exc
    frames = [f for f in traceback.extract_tb(original.__traceback__) if not _machinery(f.filename)]
    if own_file:
        own = [i for i, f in enumerate(frames) if _same_file(f.filename, own_file)]
        if own:
            frames = frames[own[0] :]
    return frames


def _deepest_own(frames: list[traceback.FrameSummary], own_file: str | None) -> int | None:
    mine = [i for i, f in enumerate(frames) if own_file and _same_file(f.filename, own_file)]
    return mine[-1] if mine else None


def raise_site(frames: list[traceback.FrameSummary], own_file: str | None) -> str:
    """``file:line`` of the deepest frame in ``own_file`` (the user's line that led to the error),
    else of the deepest frame; empty without frames."""
    if not frames:
        return ""
    own = _deepest_own(frames, own_file)
    site = frames[-1 if own is None else own]
    return f"{site.filename}:{site.lineno}"


def format_frames(
    frames: list[traceback.FrameSummary], own_file: str | None, shown: int = SHOWN_FRAMES
) -> str:
    """``shown`` frames as Python prints a traceback: the first (the reward function's entry), the
    deepest in ``own_file`` and the deepest of all, then the deepest others; a line says how many
    were left out where some were."""
    keep = {0, len(frames) - 1}
    own = _deepest_own(frames, own_file)
    if own is not None:
        keep.add(own)
    for i in range(len(frames) - 1, -1, -1):
        if len(keep) >= shown:
            break
        keep.add(i)
    lines, last = [], -1
    for i in sorted(keep):
        if i > last + 1:
            lines.append(f"  ... {i - last - 1} frame(s) left out")
        f = frames[i]
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"    {_cut(f.line.strip(), MAX_LINE_CHARS)}")
        last = i
    return "\n".join(lines)


def describe_raise(function: str, exc: BaseException, own_file: str | None) -> str:
    """``reward function F raised Type: message, at file:line`` and the last frames below it."""
    original = exc.original if isinstance(exc, Aborted) else exc
    frames = user_frames(exc, own_file)
    site = raise_site(frames, own_file)
    headline = f"reward function {function} raised {type(original).__name__}: "
    headline += _cut(str(original), MAX_MESSAGE_CHARS) + (f", at {site}" if site else "")
    return headline + ("\n" + format_frames(frames, own_file) if frames else "")
