"""The house rules on imports: ``libs/`` never imports ``services/``, and a service never imports
another one (services talk over gRPC and Redis). Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.repo.common import REPO, SKIPPED_DIRS, subdirs


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


def test_the_library_never_imports_services():
    root = REPO / "libs" / "rlmesh"
    offending = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in python_files(root)
        for line, module in imported_modules(path, package_of(path, root, "rlmesh"))
        if module == "rlmesh_services" or module.startswith("rlmesh_services.")
    ]
    assert not offending, "libs/ imports services/:\n" + "\n".join(offending)


def test_services_never_import_each_other():
    root = REPO / "services"
    offending = []
    for service in subdirs(root):
        for path in python_files(service):
            for line, module in imported_modules(path, package_of(path, root, "rlmesh_services")):
                parts = module.split(".")
                if parts[0] == "rlmesh_services" and len(parts) > 1 and parts[1] != service.name:
                    offending.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert not offending, "a service imports another service:\n" + "\n".join(offending)


def test_relative_imports_are_resolved(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from ..reward import main\nfrom . import servicer\nimport rlmesh_services.reward\n")
    found = {m for _, m in imported_modules(module, "rlmesh_services.rollout")}
    assert {
        "rlmesh_services.reward.main",
        "rlmesh_services.rollout.servicer",
        "rlmesh_services.reward",
    } <= found
