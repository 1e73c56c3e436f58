"""The repository's own files as the tests read them: where the tree is, the tree as a fresh clone
has it, the Markdown it documents itself with, and the imports of its Python files."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "libs" / "rlmesh"
CPU_DEMO = REPO / "examples" / "cpu_demo.yaml"  # the demo's config, as a user runs it
SKIPPED_DIRS = {"__pycache__"}


def ignored_patterns() -> list[str]:
    lines = (REPO / ".gitignore").read_text().splitlines()
    return [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]


def is_ignored(name: str) -> bool:
    """A name .gitignore covers (build outputs, venvs, runs): not part of the tree."""
    return name in SKIPPED_DIRS or any(fnmatch.fnmatch(name, p) for p in ignored_patterns())


def subdirs(folder: Path) -> list[Path]:
    """The folders directly under ``folder`` that a clone has: not hidden, not ignored."""
    return sorted(
        p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and not is_ignored(p.name)
    )


def top_level_dirs() -> list[Path]:
    return subdirs(REPO)


def library_packages() -> list[Path]:
    """``libs/rlmesh`` and every folder of Python code under it, at any depth."""
    found = [LIBRARY]
    for path in sorted(LIBRARY.rglob("*")):
        hidden = any(part in SKIPPED_DIRS or part.startswith(".") for part in path.relative_to(LIBRARY).parts)
        if path.is_dir() and not hidden and any(path.glob("*.py")):
            found.append(path)
    return found


def markdown_files() -> list[Path]:
    """README.md and docs/*.md: the documentation the repository ships."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    """The repository-relative form the README uses: folders end with '/'."""
    text = path.relative_to(REPO).as_posix()
    return text + "/" if path.is_dir() else text


FENCE = re.compile(r"^(```|~~~)")


def split_fenced(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, int, str]]]:
    """Lines outside fenced code blocks (line number, text), and each fenced block as (its info
    string, first line number, its text)."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[str, int, str]] = []
    info, start, body = None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line.strip()):
            if info is None:
                info, start, body = line.strip()[3:].strip(), number + 1, []
            else:
                blocks.append((info, start, "\n".join(body)))
                info = None
            continue
        if info is None:
            prose.append((number, line))
        else:
            body.append(line)
    return prose, blocks


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if not SKIPPED_DIRS.intersection(p.parts))


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, a module of ``package``; relative
    imports are resolved against it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def package_of(path: Path, root: Path, root_name: str) -> str:
    parts = path.relative_to(root).parent.parts
    return ".".join([root_name, *parts])


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page's headings (outside code blocks); a repeated heading gets
    ``-1``, ``-2``, ... as on GitHub."""
    prose, _ = split_fenced(path.read_text())
    found: set[str] = set()
    for _, line in prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base, n = slug(match.group(1)), 0
            anchor = base
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found
