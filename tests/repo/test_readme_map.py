"""The README maps the tree truthfully: its path table lists every folder and nothing that is not
there, its architecture diagram draws the services that exist, and README.md and docs/*.md link
only to files inside the repository that exist."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.support.repo import (
    LIBRARY,
    REPO,
    anchors,
    library_packages,
    markdown_files,
    rel,
    split_fenced,
    subdirs,
    top_level_dirs,
)

README = REPO / "README.md"
TABLE_START, TABLE_END = "<!-- paths:start -->", "<!-- paths:end -->"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def path_table() -> dict[str, str]:
    """The README's path table: path -> what it holds."""
    text = README.read_text()
    assert TABLE_START in text and TABLE_END in text, f"README.md has no {TABLE_START} ... {TABLE_END}"
    body = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    rows: dict[str, str] = {}
    for line in body.splitlines():
        match = ROW.match(line.strip())
        if not match:
            continue
        path, what = match.group(1), match.group(2).strip()
        assert path not in rows, f"README path table lists {path} twice"
        rows[path] = what
    assert rows, "README path table has no rows"
    return rows


def required_paths() -> set[str]:
    """Every folder the table must list: the top-level folders, the library and each of its
    packages (their sub-packages are in docs/design.md's module map), each service, each folder of
    tests."""
    folders = [
        *top_level_dirs(),
        *(p for p in library_packages() if len(p.relative_to(LIBRARY).parts) <= 1),
        *subdirs(REPO / "services"),
        *subdirs(REPO / "tests"),
    ]
    return {rel(p) for p in folders}


def test_path_table_lists_every_folder_and_nothing_absent():
    rows = path_table()
    missing = sorted(required_paths() - set(rows))
    absent = sorted(p for p in rows if not (REPO / p).exists())
    not_folders = sorted(
        p for p in rows if p.endswith("/") and (REPO / p).exists() and not (REPO / p).is_dir()
    )
    problems = []
    if missing:
        problems.append(f"not in README.md's path table: {', '.join(missing)}")
    if absent:
        problems.append(f"in README.md's path table but not in the tree: {', '.join(absent)}")
    if not_folders:
        problems.append(f"listed as folders but files: {', '.join(not_folders)}")
    assert not problems, "; ".join(problems)


def test_every_row_says_what_its_path_holds():
    empty = sorted(path for path, what in path_table().items() if not what)
    assert not empty, f"README path table rows without a description: {', '.join(empty)}"


# ---------------------------------------------------------------- the architecture diagram

NODE = re.compile(r"\b([A-Za-z]\w*)(\[\(|\[)(.*?)(?:\)\]|\])(?::::(\w+))?")


def architecture_diagram() -> str:
    text = README.read_text()
    assert "## Architecture" in text, "README.md has no Architecture section"
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    _, blocks = split_fenced(section)
    diagrams = [body for info, _, body in blocks if info == "mermaid"]
    assert diagrams, "README.md's Architecture section has no mermaid diagram"
    return diagrams[0]


def diagram_nodes() -> list[tuple[str, str, bool, bool]]:
    """(id, name, is a data store, is planned) for each node the diagram defines. A node's name is
    the first word of its label; data stores are cylinders, planned nodes have class ``planned``."""
    nodes = []
    for match in NODE.finditer(architecture_diagram()):
        node_id, shape, label, cls = match.groups()
        name = re.split(r"<br/>|\s", label.strip(), maxsplit=1)[0].lower()
        nodes.append((node_id, name, shape == "[(", cls == "planned"))
    assert nodes, "no nodes found in the architecture diagram"
    return nodes


def service_folders() -> set[str]:
    return {p.name for p in subdirs(REPO / "services")}


def test_diagram_draws_only_services_that_exist():
    services = service_folders()
    drawn = [
        (node_id, name) for node_id, name, store, planned in diagram_nodes() if not store and not planned
    ]
    not_there = sorted(f"{name} (node {node_id})" for node_id, name in drawn if name not in services)
    assert not not_there, (
        f"the README diagram draws services with no folder in services/: {', '.join(not_there)}; "
        "build them or mark them planned (:::planned)"
    )


def test_diagram_draws_every_service_and_marks_no_built_one_planned():
    services = service_folders()
    nodes = diagram_nodes()
    drawn = {name for _, name, store, planned in nodes if not store and not planned}
    undrawn = sorted(services - drawn)
    assert not undrawn, f"services/ has folders the README diagram does not draw: {', '.join(undrawn)}"
    built_but_planned = sorted(name for _, name, _, planned in nodes if planned and name in services)
    assert not built_but_planned, (
        f"the README diagram marks services as planned that exist in services/: {', '.join(built_but_planned)}"
    )


# ---------------------------------------------------------------- links

INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# Where the design and notes lived before they came into the repository.
OUTSIDE_NOTES = ("../shared/", "shared/notes/", "shared/DESIGN.md")


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown, reference-style and HTML link outside code."""
    prose, _ = split_fenced(path.read_text())
    found = []
    for number, line in prose:
        line = INLINE_CODE.sub("", line)
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
        found += [(number, m.group(1)) for m in HTML_LINK.finditer(line)]
        match = REFERENCE_LINK.match(line)
        if match:
            found.append((number, match.group(1)))
    return found


def link_problems(path: Path) -> list[str]:
    problems = []
    where = path.relative_to(REPO).as_posix()
    for number, target in links(path):
        if SCHEME.match(target):
            continue  # a URL
        file_part, _, anchor = target.partition("#")
        file_part = file_part.split("?", 1)[0]
        if not file_part:
            if anchor and anchor not in anchors(path):
                problems.append(f"{where}:{number}: #{anchor} is no heading of {where}")
            continue
        if file_part.startswith("/"):
            problems.append(f"{where}:{number}: {target} is an absolute path; link relative to {where}")
            continue
        resolved = Path(os.path.normpath(path.parent / file_part))
        if os.path.relpath(resolved, REPO).startswith(".."):
            problems.append(f"{where}:{number}: {target} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}:{number}: {target} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}:{number}: {target}: no such heading in {file_part}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_stay_in_the_repository_and_resolve(path):
    problems = link_problems(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_reference_to_notes_outside_the_repository(path):
    text = path.read_text()
    where = path.relative_to(REPO).as_posix()
    found = [
        f"{where}:{number}: {needle}"
        for number, line in enumerate(text.splitlines(), start=1)
        for needle in OUTSIDE_NOTES
        if needle in line
    ]
    if path == README:  # at the root, any ../ leaves the repository
        found += [
            f"{where}:{number}: ../"
            for number, line in enumerate(text.splitlines(), start=1)
            if "../" in line
        ]
    assert not found, "references to paths outside the repository (docs/design.md is in it):\n" + "\n".join(
        found
    )


def test_link_checker_catches_what_it_should(tmp_path, monkeypatch):
    """The checker itself: an outside link, a missing file, a missing anchor are each reported."""
    monkeypatch.setattr("tests.repo.test_readme_map.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n[out](../shared/DESIGN.md) [gone](docs/b.md) [ok](docs/a.md#a-title)\n"
        "[bad anchor](docs/a.md#nope) [here](#top) [nowhere](#nowhere) [web](https://example.com/x)\n"
        "```\n[not a link](../in/code)\n```\n`[code](../span)`\n"
    )
    problems = link_problems(page)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "../shared/DESIGN.md points outside the repository",
        "docs/b.md does not exist",
        "docs/a.md#nope: no such heading in docs/a.md",
        "#nowhere is no heading of README.md",
    ]


# ---------------------------------------------------------------- length and figures

README_MAX_LINES = 200  # issue 33: a newcomer reads it in five minutes; the rest lives in docs/
FIGURE_ROW = re.compile(r"^\|(.+)\|(.+)\|\s*$")


def test_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to a page in docs/"
    )


def test_every_headline_figure_names_its_command():
    text = README.read_text()
    assert "## Headline figures" in text, "README.md has no Headline figures section"
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [FIGURE_ROW.match(line.strip()) for line in section.splitlines() if line.startswith("|")]
    body = [m for m in rows[2:] if m]  # past the header and its rule
    assert body, "the Headline figures table has no rows"
    bare = [m.group(1).strip() for m in body if not re.search(r"`[^`]+`", m.group(2))]
    assert not bare, "headline figures without the command that reproduces them:\n" + "\n".join(bare)
