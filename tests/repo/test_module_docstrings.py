"""A module docstring says what the module is in at most three lines; the why and how live in docs/,
and a ``docs/<page>.md#anchor`` pointer in a module docstring names a page and a heading that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.repo import LIBRARY, REPO, anchors, python_files, slug

MAX_LINES = 3
GENERATED = LIBRARY / "v1"

# docs/<page>.md, optionally with #anchor, not inside a longer path or a URL.
POINTER = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)(?:#([\w-]+))?")


def source_files() -> list[Path]:
    """Every module of the library (but the generated ``v1/``) and of the services."""
    library = [p for p in python_files(LIBRARY) if GENERATED not in p.parents]
    return library + python_files(REPO / "services")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def module_docstring(path: Path) -> tuple[str, int] | None:
    """The module docstring and the number of source lines it takes, or None without one."""
    body = ast.parse(path.read_text()).body
    if not body or not isinstance(body[0], ast.Expr):
        return None
    node = body[0].value
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return None
    return node.value, node.end_lineno - node.lineno + 1


def test_module_docstrings_are_at_most_three_lines():
    offenders = []
    for path in source_files():
        where = rel(path)
        found = module_docstring(path)
        if found is None:
            if path.name != "__init__.py":
                offenders.append(f"{where}: no module docstring")
            continue
        _, lines = found
        if lines > MAX_LINES:
            offenders.append(f"{where}: {lines} lines")
    assert not offenders, (
        f"module docstrings over {MAX_LINES} lines (say what the module is; move the detail to docs/):\n"
        + "\n".join(offenders)
    )


def test_docstring_pointers_name_existing_pages_and_headings():
    problems = []
    for path in source_files():
        found = module_docstring(path)
        if found is None:
            continue
        for match in POINTER.finditer(found[0]):
            page, anchor = REPO / "docs" / match.group(1), match.group(2)
            pointer = match.group(0)
            if not page.is_file():
                problems.append(f"{rel(path)}: {pointer}: no such page")
            elif anchor and anchor not in anchors(page):
                problems.append(f"{rel(path)}: {pointer}: no such heading in {rel(page)}")
    assert not problems, "module docstrings point at docs that are not there:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Weight sync", "weight-sync"),
        ("One PPO step, as data", "one-ppo-step-as-data"),
        ("Advantage estimators — `algorithm.adv_estimator`", "advantage-estimators--algorithmadv_estimator"),
        ("`rlmesh demo`", "rlmesh-demo"),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_pointer_pattern_skips_urls_and_longer_paths():
    text = "see docs/design.md#weight-sync, https://x.org/docs/y.md and a/docs/z.md"
    assert [m.group(0) for m in POINTER.finditer(text)] == ["docs/design.md#weight-sync"]
