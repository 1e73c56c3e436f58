"""Keeps the key tables in README.md and docs/config.md equal to the schema (``make docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

from rlmesh.config.keys import keys_markdown_table

START, END = "<!-- config-keys:start -->", "<!-- config-keys:end -->"
REPO_ROOT = Path(__file__).resolve().parents[3]


def readme_section() -> str:
    return (
        "<details><summary>Every key rlmesh uses, with its default (click to open)</summary>\n\n"
        + keys_markdown_table(include_compat=False)
        + "\n\n</details>\n\nThe verl keys that are accepted but have no effect are listed, each with the "
        "reason, in [docs/config.md](docs/config.md#keys-rlmesh-ignores); a config that sets any of them "
        "gets one warning at start-up naming them (`rlmesh config validate` prints it too)."
    )


def verl_map_markdown() -> str:
    """The tables of :mod:`rlmesh.config.verl_map`: keys read under rlmesh's name, and keys refused
    unless at their default."""
    from rlmesh.config.verl_map import MOVED, REFUSED

    lines = [
        "## Keys rlmesh maps",
        "",
        "verl keys that rlmesh reads under its own name (verl renamed or moved them between releases). "
        "A config that sets any of them is told, in one warning at start-up, what each was read as; "
        "giving both names with different values is an error.",
        "",
        "| verl's key | read as |",
        "|---|---|",
        *(f"| `{src}` | `{dst}` |" for src, dst in MOVED),
        "",
        "`actor_rollout_ref.rollout.name`: `vllm`, `trtllm` or not set run SGLang on a machine with a "
        "CUDA GPU and the embedded engine on one without; `hf` runs the embedded engine. verl's rollout "
        "knobs reach SGLang as its flags (`enforce_eager`, `max_model_len`, `max_num_seqs`, "
        "`max_num_batched_tokens`, `enable_chunked_prefill`, `enable_prefix_caching`, "
        "`engine_kwargs.sglang.*`, `model.override_config`; see the table above); "
        "`engine_kwargs.vllm` / `trtllm` are named and dropped.",
        "",
        "## Keys rlmesh refuses unless at their default",
        "",
        "verl keys whose being ignored would change what a run computes; set to anything but their "
        "default, the config is refused with what to do instead.",
        "",
        "| key | instead |",
        "|---|---|",
        *(f"| `{key}` | {instead} |" for key, _, instead in REFUSED),
    ]
    return "\n".join(lines) + "\n"


def config_doc() -> str:
    return (
        "# Configuration keys\n\nGenerated from the schema by `make docs`; do not edit by hand.\n"
        "Defaults equal verl's `ppo_trainer.yaml` wherever verl has the key.\n\n"
        + keys_markdown_table(include_compat=True)
        + "\n"
        + verl_map_markdown()
    )


def render_readme(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"README has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{readme_section()}\n{END}{tail}"


def sync(root: Path = REPO_ROOT, check: bool = False) -> list[str]:
    """Returns the files that were (or, with ``check``, would be) changed."""
    changed = []
    for path, new in (
        (root / "README.md", render_readme((root / "README.md").read_text())),
        (root / "docs" / "config.md", config_doc()),
    ):
        old = path.read_text() if path.exists() else ""
        if old != new:
            changed.append(str(path.relative_to(root)))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(new)
    return changed


if __name__ == "__main__":
    stale = sync(check="--check" in sys.argv)
    print("updated: " + ", ".join(stale) if stale else "config key tables are current")
    sys.exit(1 if stale and "--check" in sys.argv else 0)
