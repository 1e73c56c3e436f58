"""The library's packages in layers, and the learner's parts in layers of their own: every import
goes to a strictly lower layer, so no two import each other and nothing points upward.
docs/design.md holds the pictures this test draws from the imports; a failing test prints the new one."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.repo import LIBRARY, REPO, imported_modules, package_of, python_files


@dataclass(frozen=True)
class Layering:
    root: Path  # the package whose parts are layered
    dotted: str  # its import name
    layers: list[tuple[str, ...]]  # bottom to top
    marker: str  # the block of docs/design.md that holds its picture
    top_line: str  # the picture's first line: what sits above it

    @property
    def layer_of(self) -> dict[str, int]:
        return {part: i for i, layer in enumerate(self.layers) for part in layer}

    def parts(self) -> set[str]:
        """Its sub-packages and top-level modules."""
        return {p.name for p in self.root.iterdir() if (p / "__init__.py").exists()} | {
            p.stem for p in self.root.glob("*.py") if p.stem != "__init__"
        }

    def imports(self) -> dict[tuple[str, str], list[str]]:
        """(importer, imported) part pairs, each with the ``file:line`` places."""
        edges: dict[tuple[str, str], list[str]] = defaultdict(list)
        parts, depth = self.parts(), len(self.dotted.split("."))
        for path in python_files(self.root):
            rel = path.relative_to(self.root)
            importer = rel.parts[0] if len(rel.parts) > 1 else rel.stem
            if importer == "__init__":
                continue
            for line, module in imported_modules(path, package_of(path, self.root, self.dotted)):
                names = module.split(".")
                if names[:depth] != self.dotted.split(".") or len(names) <= depth:
                    continue
                if names[depth] != importer and names[depth] in parts:
                    edges[(importer, names[depth])].append(f"{path.relative_to(REPO)}:{line}")
        return edges

    def picture(self) -> str:
        """One line per part, top layer first: the parts it imports."""
        deps: dict[str, set[str]] = defaultdict(set)
        for importer, imported in self.imports():
            deps[importer].add(imported)
        width = max(len(p) for p in self.layer_of) + 1
        lines = ["```text", self.top_line]
        for layer in reversed(self.layers):
            for part in layer:
                below = sorted(deps[part], key=lambda d: (-self.layer_of[d], d))
                lines.append(f"{part:<{width}}  ->  {', '.join(below) or '-'}")
            lines.append("")
        lines[-1] = "```"
        return "\n".join(lines)

    def upward(self, edges: dict[tuple[str, str], list[str]]) -> list[str]:
        at = self.layer_of
        return [
            f"{importer} (layer {at[importer]}) imports {imported} (layer {at[imported]}) at "
            + ", ".join(places)
            for (importer, imported), places in sorted(edges.items())
            if importer in at and imported in at and at[imported] >= at[importer]
        ]


LIBRARY_LAYERS = Layering(
    root=LIBRARY,
    dotted="rlmesh",
    layers=[
        ("v1",),  # generated from protos/
        ("algo", "config", "data", "models", "weights", "wire"),  # formulas, config, data, formats
        ("runtime",),  # the service base, processes, networking
        ("queue",),  # the run's Redis protocol
        ("engine", "reference", "reward"),  # the services' cores and their clients
        ("control", "learner", "rollout"),  # the roles, and the control plane over them
        ("job",),  # whole jobs: train, demo, up, the stack starter
        ("ray",),  # jobs on a Ray cluster: every service an actor
        ("cli",),  # the rlmesh command
    ],
    marker="package-layers",
    top_line="services/*  ->  any package below (each a shell over one of them)",
)
LEARNER_LAYERS = Layering(
    root=LIBRARY / "learner",
    dotted="rlmesh.learner",
    layers=[
        ("dist",),  # the process group over the data-parallel ranks
        ("ppo",),  # actor, critic and their update loops, the batch layout, model loading
        ("weight_sync",),  # full weights bucket by bucket, pushed to the engines
        ("checkpoints",),  # atomic checkpoints, HF directories
        ("sft", "trainer"),  # the supervised warm-up; PPOTrainer, the PPO core as a library
        ("run",),  # the run loop, its wiring, the rank protocol, the servicer
    ],
    marker="learner-layers",
    top_line="services/learner  ->  run (rank 0 serves it; the other ranks follow)",
)
LAYERINGS = [LIBRARY_LAYERS, LEARNER_LAYERS]


@pytest.mark.parametrize("layering", LAYERINGS, ids=lambda layering: layering.dotted)
def test_every_part_has_a_layer(layering: Layering):
    missing = sorted(layering.parts() - set(layering.layer_of))
    assert not missing, f"parts of {layering.dotted} without a layer: {missing}"


@pytest.mark.parametrize("layering", LAYERINGS, ids=lambda layering: layering.dotted)
def test_imports_only_go_down(layering: Layering):
    upward = layering.upward(layering.imports())
    assert not upward, f"imports sideways or upward between parts of {layering.dotted}:\n" + "\n".join(upward)


@pytest.mark.parametrize("layering", LAYERINGS, ids=lambda layering: layering.dotted)
def test_the_design_doc_holds_the_current_picture(layering: Layering):
    begin, end = f"<!-- {layering.marker}:begin -->", f"<!-- {layering.marker}:end -->"
    text = (REPO / "docs" / "design.md").read_text()
    assert begin in text and end in text, f"docs/design.md lacks the {begin} ... {end} block"
    held = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert held == layering.picture(), (
        f"docs/design.md's {layering.marker} picture is stale; replace the block with:\n" + layering.picture()
    )


def test_an_upward_import_is_caught():
    fake = {("weights", "learner"): ["libs/rlmesh/weights/x.py:1"]}
    assert LIBRARY_LAYERS.upward(fake) == [
        "weights (layer 1) imports learner (layer 5) at libs/rlmesh/weights/x.py:1"
    ]
    assert LEARNER_LAYERS.upward({("ppo", "run"): ["libs/rlmesh/learner/ppo/x.py:1"]}) == [
        "ppo (layer 1) imports run (layer 5) at libs/rlmesh/learner/ppo/x.py:1"
    ]


def test_the_learner_imports_are_seen():
    assert ("run", "trainer") in LEARNER_LAYERS.imports()
