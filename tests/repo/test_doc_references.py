"""README.md and docs/*.md name only paths and modules that exist: a file moved or a module
renamed (``training/`` into ``learner/``, ``weights/push.py`` to ``learner/weight_sync/push.py``) fails
here until the docs follow."""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

from tests.support.repo import REPO, markdown_files, top_level_dirs

# A path into the tree: it starts with a top-level folder and is not part of a URL or a longer path.
# It ends where a placeholder (<name>, *, {...}) or anything else that is not a path character begins.
PATH_CHARS = r"[\w./-]"


def tree_path_pattern(tops: list[str]) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w./~:-])((?:{'|'.join(map(re.escape, tops))})/{PATH_CHARS}*)")


DOTTED = re.compile(r"(?<![\w.])(rlmesh(?:_services)?(?:\.[A-Za-z_]\w*)+)")


def named_paths(text: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for match in pattern.finditer(line):
            path = match.group(1).rstrip(".")
            if path.endswith("/.."):
                continue
            found.append((number, path))
    return found


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_paths_named_in_the_docs_exist(doc):
    pattern = tree_path_pattern([p.name for p in top_level_dirs()])
    where = doc.relative_to(REPO).as_posix()
    missing = [
        f"{where}:{number}: {path}"
        for number, path in named_paths(doc.read_text(), pattern)
        if not (REPO / path).exists() or (path.endswith("/") and not (REPO / path).is_dir())
    ]
    assert not missing, "paths the docs name that are not in the tree:\n" + "\n".join(missing)


# ---------------------------------------------------------------- dotted names


@cache
def config_keys() -> tuple[str, ...]:
    from rlmesh.config import config_keys as keys

    return tuple(k.key for k in keys())


@cache
def entry_point_groups() -> frozenset[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return frozenset(project.get("entry-points", {}))


@cache
def proto_names() -> frozenset[str]:
    names = set()
    for proto in (REPO / "protos").rglob("*.proto"):
        names |= set(re.findall(r"^\s*(?:message|service|enum)\s+(\w+)", proto.read_text(), re.M))
    return frozenset(names)


SOURCE_ROOTS = {"rlmesh": REPO / "libs" / "rlmesh", "rlmesh_services": REPO / "services"}


def module_file(parts: list[str]) -> Path | None:
    base = SOURCE_ROOTS[parts[0]].joinpath(*parts[1:])
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level, imports, or lists in ``__all__``."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value:
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def dotted_name_problem(name: str) -> str | None:
    """Why ``name`` (``rlmesh.x.y``) names nothing, or None: it is a config key or a section of
    keys, an entry-point group, or a module with, optionally, a name it defines (then attributes)."""
    if name.startswith("rlmesh.") and any(k == name or k.startswith(name + ".") for k in config_keys()):
        return None
    if name in entry_point_groups():
        return None
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(parts[:i])
        if path is None:
            continue
        rest = parts[i:]
        if not rest:
            return None
        if parts[:2] == ["rlmesh", "v1"] and rest[0] in proto_names():
            return None  # a proto service or message, by its full name
        if rest[0] in defined_names(path) or module_file(parts[: i + 1]) is not None:
            return None
        module = ".".join(parts[:i])
        return f"{module} has no {rest[0]}"
    return f"no module {parts[0]}"


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_modules_named_in_the_docs_exist(doc):
    where = doc.relative_to(REPO).as_posix()
    problems = []
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        for match in DOTTED.finditer(line):
            why = dotted_name_problem(match.group(1))
            if why:
                problems.append(f"{where}:{number}: {match.group(1)}: {why}")
    assert not problems, "module names the docs use that do not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("rlmesh.job.stack.start_stack", True),
        ("rlmesh.learner.weight_sync.push", True),
        ("rlmesh.reward.addresses", True),  # a config key, and a module
        ("rlmesh.weight_sync.load_format", True),  # a config key
        ("rlmesh.services", True),  # the entry-point group
        ("rlmesh.v1.Learner", True),  # a proto service
        ("rlmesh.training.loop", False),  # merged into rlmesh.learner
        ("rlmesh.weights.push", False),  # now rlmesh.learner.weight_sync.push
        ("rlmesh.runtime.stack", False),  # now rlmesh.job.stack
        ("rlmesh.rollout.policy", False),  # now rlmesh.queue.policy
        ("rlmesh.data.sampler", False),  # now rlmesh.data.cursor
        ("rlmesh.job.stack.no_such_function", False),
    ],
)
def test_the_checker_tells_old_names_from_current_ones(name, ok):
    assert (dotted_name_problem(name) is None) is ok, dotted_name_problem(name)


def test_the_path_pattern_skips_urls_and_placeholders():
    pattern = tree_path_pattern(["docs", "services"])
    text = "see docs/design.md, https://x.org/docs/y and `services/<name>/main.py`; a/docs/z"
    assert [p for _, p in named_paths(text, pattern)] == ["docs/design.md", "services/"]
