"""A module name under libs/rlmesh means one thing: two modules (or a module and a package) share a
name only where it is the same kind of thing in each package, as listed in SAME_MEANING."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tests.support.repo import LIBRARY, python_files

# Names that mean the same thing in every package holding one: a reader who knows one knows the
# others. A name that means something else in one of them is renamed there, not added here.
SAME_MEANING = {
    "app": "the package's FastAPI app and its create_app (control plane, embedded engine)",
    "cli": "the package's command line (rlmesh, rlmesh data, rlmesh ray)",
    "client": "the client other processes call the package's service with (engine, reference, reward)",
    "errors": "the package's one error type for what it was given (ConfigError, ControlError, DatasetError)",
    "metrics": "the package's Prometheus series",
    "servicer": "the package's gRPC servicer",
    # One task, named as verl names it: data/ writes its dataset, reward/ scores its answers.
    "arithmetic": "the synthetic arithmetic task",
    "gsm8k": "the GSM8K task",
}


def name_places(root: Path) -> dict[str, list[str]]:
    """Every module and package name under ``root``, each with where it is (paths relative to root)."""
    places: dict[str, list[str]] = defaultdict(list)
    for path in python_files(root):
        if path.name != "__init__.py":
            places[path.stem].append(path.relative_to(root).as_posix())
    for init in python_files(root):
        if init.name == "__init__.py" and init.parent != root:
            places[init.parent.name].append(init.parent.relative_to(root).as_posix() + "/")
    return places


def shared_names(root: Path, allowed: set[str]) -> dict[str, list[str]]:
    """Names held by two or more modules or packages, less the ``allowed`` ones."""
    return {
        name: sorted(where)
        for name, where in sorted(name_places(root).items())
        if len(where) > 1 and name not in allowed
    }


def test_module_names_under_libs_rlmesh_are_unique():
    shared = shared_names(LIBRARY, set(SAME_MEANING))
    assert not shared, (
        "names used for more than one module or package under libs/rlmesh; rename one to say what it "
        "is (or, where each means the same thing, add it to SAME_MEANING with why):\n"
        + "\n".join(f"{name}: {', '.join(where)}" for name, where in shared.items())
    )


def test_every_same_meaning_name_is_still_shared():
    places = name_places(LIBRARY)
    stale = sorted(name for name in SAME_MEANING if len(places.get(name, [])) < 2)
    assert not stale, f"SAME_MEANING names held by one module or none; drop them: {stale}"


def test_a_shared_name_is_caught(tmp_path):
    for rel in (
        "control/__init__.py",
        "control/policy.py",
        "control/servicer.py",
        "queue/__init__.py",
        "queue/policy.py",
        "learner/__init__.py",
        "learner/models.py",
        "learner/run/servicer.py",
        "models/__init__.py",
        "models/tiny.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert shared_names(tmp_path, {"servicer"}) == {
        "models": ["learner/models.py", "models/"],
        "policy": ["control/policy.py", "queue/policy.py"],
    }
