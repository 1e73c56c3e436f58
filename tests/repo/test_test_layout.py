"""The tests' own layout: ``tests/unit`` and ``tests/integration`` mirror ``libs/rlmesh``, helpers and
the programs tests start live in ``tests/support``, and no test module doubles as a program."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.repo import LIBRARY, REPO, is_ignored

MIRRORS = ("unit", "integration")  # folders of tests named after what they test in libs/rlmesh
SUPPORT = "support"  # helpers and programs: the one folder of tests/ that holds other files
TEST_FOLDER_FILES = ("__init__.py", "conftest.py")


def in_tree(path: Path, root: Path) -> bool:
    """Part of the tree a clone has: not hidden, not ignored (``__pycache__``, build outputs)."""
    return not any(part.startswith(".") or is_ignored(part) for part in path.relative_to(root).parts)


def folder_problems(tests: Path, library: Path) -> list[str]:
    """Folders under tests/unit and tests/integration not named after a package or module of the library."""
    problems = []
    for suite in MIRRORS:
        root = tests / suite
        for folder in sorted(p for p in root.rglob("*") if p.is_dir() and in_tree(p, root)):
            target = library.joinpath(*folder.relative_to(root).parts)
            if not (target.is_dir() or target.with_suffix(".py").is_file()):
                problems.append(
                    f"{folder.relative_to(tests.parent)}/: no package or module "
                    f"{target.relative_to(library.parent)}(.py)"
                )
    return problems


def is_test_folder_file(name: str) -> bool:
    return name in TEST_FOLDER_FILES or (name.startswith("test_") and name.endswith(".py"))


def file_problems(tests: Path) -> list[str]:
    """Files outside tests/support that are neither a test module, a conftest.py nor an __init__.py,
    and test modules inside it."""
    problems = []
    for path in sorted(p for p in tests.rglob("*") if p.is_file() and in_tree(p, tests)):
        where = path.relative_to(tests.parent).as_posix()
        in_support = path.relative_to(tests).parts[0] == SUPPORT
        if in_support and path.name.startswith("test_"):
            problems.append(f"{where}: a test module in {SUPPORT}/ (helpers and programs only)")
        elif not in_support and not is_test_folder_file(path.name):
            problems.append(f"{where}: not a test module; helpers and programs go in tests/{SUPPORT}/")
    return problems


def runs_as_main(path: Path) -> bool:
    """True if the module has a top-level ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = [node.test.left, *node.test.comparators]
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
                isinstance(n, ast.Constant) and n.value == "__main__" for n in names
            ):
                return True
    return False


def main_problems(tests: Path) -> list[str]:
    """Test modules with an ``if __name__ == "__main__":`` block."""
    return [
        f"{path.relative_to(tests.parent).as_posix()}: runs as a program; "
        f"move that part to tests/{SUPPORT}/programs/"
        for path in sorted(tests.rglob("test_*.py"))
        if in_tree(path, tests) and runs_as_main(path)
    ]


def test_unit_and_integration_folders_are_named_after_library_packages():
    problems = folder_problems(REPO / "tests", LIBRARY)
    assert not problems, "tests/unit and tests/integration mirror libs/rlmesh:\n" + "\n".join(problems)


def test_test_folders_hold_only_tests_and_support_only_helpers():
    problems = file_problems(REPO / "tests")
    assert not problems, "\n".join(problems)


def test_no_test_module_is_a_program():
    problems = main_problems(REPO / "tests")
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_should(tmp_path):
    """The checkers themselves, on a made-up tree."""
    library = tmp_path / "libs" / "rlmesh"
    (library / "queue").mkdir(parents=True)
    (library / "cli.py").write_text("")
    tests = tmp_path / "tests"
    for folder in ("unit/queue", "unit/cli", "unit/queues", "integration/misc", "support/programs", "e2e"):
        (tests / folder).mkdir(parents=True)
    (tests / "unit" / "queue" / "test_streams.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tests / "unit" / "queue" / "helpers.py").write_text("")
    (tests / "unit" / "queue" / "conftest.py").write_text("")
    (tests / "e2e" / "common.py").write_text("")
    (tests / "support" / "stack.py").write_text("")
    (tests / "support" / "test_stack.py").write_text("")
    (tests / "support" / "programs" / "worker.py").write_text('if "__main__" == __name__:\n    pass\n')

    assert folder_problems(tests, library) == [
        "tests/unit/queues/: no package or module rlmesh/queues(.py)",
        "tests/integration/misc/: no package or module rlmesh/misc(.py)",
    ]
    assert file_problems(tests) == [
        "tests/e2e/common.py: not a test module; helpers and programs go in tests/support/",
        "tests/support/test_stack.py: a test module in support/ (helpers and programs only)",
        "tests/unit/queue/helpers.py: not a test module; helpers and programs go in tests/support/",
    ]
    assert main_problems(tests) == [
        "tests/unit/queue/test_streams.py: runs as a program; move that part to tests/support/programs/"
    ]
