"""The library's packages in layers: every import goes to a strictly lower layer, so no two
packages import each other and nothing points upward. docs/design.md holds the picture this test
draws from the imports; after a change, the failing test prints the new one."""

from __future__ import annotations

import sys
from collections import defaultdict

from tests.support.repo import LIBRARY, REPO, imported_modules, package_of, python_files

# Bottom to top. A new package must be placed here before it is imported by anything.
LAYERS: list[tuple[str, ...]] = [
    ("v1",),  # generated from protos/
    ("algo", "config", "data", "models", "weights", "wire"),  # formulas, config, data, formats
    ("queue", "runtime"),  # the run's Redis protocol; the service base, processes, networking
    ("engine", "reference", "reward"),  # the services' cores and their clients
    ("control", "learner", "rollout"),  # the roles, and the control plane over them
    ("job",),  # whole jobs: train, demo, up, the stack starter
    ("ray",),  # jobs on a Ray cluster: every service an actor
    ("cli",),  # the rlmesh command
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
BEGIN, END = "<!-- package-layers:begin -->", "<!-- package-layers:end -->"


def library_packages() -> set[str]:
    return {p.name for p in LIBRARY.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in LIBRARY.glob("*.py") if p.stem != "__init__"
    }


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs of ``rlmesh``, each with the ``file:line`` places."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    packages = library_packages()
    for path in python_files(LIBRARY):
        rel = path.relative_to(LIBRARY)
        importer = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if importer == "__init__":
            continue
        for line, module in imported_modules(path, package_of(path, LIBRARY, "rlmesh")):
            parts = module.split(".")
            if parts[0] == "rlmesh" and len(parts) > 1 and parts[1] != importer and parts[1] in packages:
                edges[(importer, parts[1])].append(f"{path.relative_to(REPO)}:{line}")
    return edges


def picture() -> str:
    """One line per package, top layer first: the packages it imports."""
    deps: dict[str, set[str]] = defaultdict(set)
    for importer, imported in package_imports():
        deps[importer].add(imported)
    lines = ["```text", "services/*  ->  any package below (each a shell over one of them)"]
    for layer in reversed(LAYERS):
        for pkg in layer:
            lines.append(
                f"{pkg:<10}  ->  {', '.join(sorted(deps[pkg], key=lambda d: (-LAYER_OF[d], d))) or '-'}"
            )
        lines.append("")
    lines[-1] = "```"
    return "\n".join(lines)


def test_every_package_has_a_layer():
    missing = sorted(library_packages() - set(LAYER_OF))
    assert not missing, f"packages of libs/rlmesh without a layer in LAYERS: {missing}"


def test_imports_only_go_down():
    upward = [
        f"{importer} (layer {LAYER_OF[importer]}) imports {imported} (layer {LAYER_OF[imported]}) at "
        + ", ".join(places)
        for (importer, imported), places in sorted(package_imports().items())
        if importer in LAYER_OF and imported in LAYER_OF and LAYER_OF[imported] >= LAYER_OF[importer]
    ]
    assert not upward, "imports sideways or upward between packages:\n" + "\n".join(upward)


def test_the_design_doc_holds_the_current_picture():
    text = (REPO / "docs" / "design.md").read_text()
    assert BEGIN in text and END in text, f"docs/design.md lacks the {BEGIN} ... {END} block"
    held = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert held == picture(), (
        "docs/design.md's package picture is stale; replace the block with:\n" + picture()
    )


def test_an_upward_import_is_caught(monkeypatch):
    fake = {("weights", "learner"): ["libs/rlmesh/weights/x.py:1"]}
    monkeypatch.setattr(sys.modules[__name__], "package_imports", lambda: fake)
    try:
        test_imports_only_go_down()
    except AssertionError as e:
        assert "weights (layer 1) imports learner (layer 4)" in str(e)
    else:
        raise AssertionError("an import from weights to learner passed")
