"""constraints.txt is the locked environment: it must pin every requirement of pyproject.toml (and
of its dev extra) to a version that requirement allows, pin the whole transitive closure, and be
what this venv has installed. Any drift between the three fails here with the package named."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, distribution

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.repo import REPO

LOCKED_EXTRAS = ("dev",)


def read_lock(name: str = "constraints.txt") -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, line in enumerate((REPO / name).read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        package, sep, version = line.partition("==")
        assert sep and version, f"{name}:{number}: {line!r} is not NAME==VERSION"
        key = canonicalize_name(package)
        assert key not in pins, f"{name}:{number}: {package} is pinned twice"
        pins[key] = Version(version)
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in LOCKED_EXTRAS:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    envs = [{**default_environment(), "extra": e} for e in (extras or {""})]
    return any(req.marker.evaluate(env) for env in envs)


def test_every_project_requirement_is_pinned_within_its_range():
    pins = read_lock()
    problems = []
    for req in project_requirements():
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req} (pyproject.toml) is not pinned in constraints.txt")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"constraints.txt pins {req.name}=={pinned}, outside pyproject's {req}")
    assert not problems, "\n".join(problems)


def test_the_lock_is_closed_under_dependencies_and_is_what_is_installed():
    """Walks the installed dependency graph from the project's requirements: every package reached
    must be pinned, and installed at its pin (the venv came from this lock, or the lock is stale)."""
    pins = read_lock()
    problems: list[str] = []
    seen: set[str] = set()
    todo = [(req, "pyproject.toml") for req in project_requirements()]
    while todo:
        req, needed_by = todo.pop()
        key = canonicalize_name(req.name)
        if key in seen:
            continue
        seen.add(key)
        if key not in pins:
            problems.append(f"{req.name} (needed by {needed_by}) is not pinned in constraints.txt")
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            problems.append(f"{req.name} (needed by {needed_by}) is not installed")
            continue
        installed = Version(dist.version)
        if key in pins and Version(installed.public) != pins[key]:
            problems.append(f"{req.name} is installed at {installed}, constraints.txt pins {pins[key]}")
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            if applies(sub_req, set(req.extras)):
                todo.append((sub_req, req.name))
    unused = sorted(set(pins) - seen)
    if unused:
        problems.append(f"constraints.txt pins packages nothing requires: {', '.join(unused)}")
    assert not problems, "\n".join(problems)


def test_the_gpu_lock_pins_every_project_requirement_and_sglangs_torch():
    """constraints-gpu.txt (`make lock-gpu`; `make gpu-lock-check` resolves against it): rlmesh's
    own requirements within their ranges, sglang's, and torch as the CUDA image installs it."""
    pins = read_lock("constraints-gpu.txt")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for req in [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]:
        key = canonicalize_name(req.name)
        assert key in pins, f"constraints-gpu.txt does not pin {req.name}"
        assert pins[key] in req.specifier, f"constraints-gpu.txt: {req.name}=={pins[key]} outside {req}"
    compose = (REPO / "examples" / "gpu_qwen2.5-0.5b_gsm8k.compose.yml").read_text()
    assert f'TORCH_VERSION: "{pins["torch"]}"' in compose and "CONSTRAINTS: constraints-gpu.txt" in compose
    assert '-c "$CONSTRAINTS"' in (REPO / "deploy" / "Dockerfile").read_text()
