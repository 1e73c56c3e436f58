"""The house rules on imports: ``libs/`` never imports ``services/``, and a service never imports
another one (services talk over gRPC and Redis). Imports inside functions count too."""

from __future__ import annotations

from tests.support.repo import REPO, imported_modules, package_of, python_files, subdirs


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
