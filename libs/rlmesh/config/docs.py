"""Writes docs/config.md, every key rlmesh reads with its default, from the schema (``make docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

from rlmesh.config.key_catalog import keys_markdown_table

REPO_ROOT = Path(__file__).resolve().parents[3]

# The page's prose: how a config is given and checked. The tables below it are generated.
INTRO = """\
# Configuration keys

Generated from the schema by `make docs` (`rlmesh.config.docs`); do not edit by hand.

One typed tree with verl's key names and verl's defaults, from a YAML file plus dotted overrides
typed exactly as verl users type them:

```bash
rlmesh config show --config examples/cpu_demo.yaml actor_rollout_ref.actor.clip_ratio=0.2 "trainer.logger=['console','wandb']"
```

verl's own command lines load as written: every leaf of verl's generated PPO config of 0.5.0,
0.6.1, 0.7.0 and 0.9.1, and the key=value parts of 28 of verl's example scripts, are checked in
`make test` (`tests/unit/config/test_verl_corpus.py`, fixtures in `tests/support/verl_corpus/`).
A verl key rlmesh reads under another name (`update_weights_bucket_megabytes`, 0.9's `reward.*`
section), verl's engine names (`rollout.name=vllm` runs SGLang on a GPU machine, the embedded
engine elsewhere) and every ignored key are named in one warning each at start-up, which
`rlmesh config validate` prints; a key whose being ignored would change the result (a tool-use
rollout, a sandbox reward, distillation) is refused with what to use instead
([Keys rlmesh maps](#keys-rlmesh-maps), [Keys rlmesh refuses](#keys-rlmesh-refuses-unless-at-their-default)).

Unknown keys fail and name the closest valid ones; bad values name the key, the value and what
is allowed; cross-field checks (mini batch divides the batch, micro divides mini, …) fail with
the numbers. Below, every key and its default (`rlmesh config keys` prints the same; a test keeps
this page current). Defaults equal verl's `ppo_trainer.yaml` wherever verl has the key. The verl
keys that are accepted but have no effect are listed, each with the reason, in
[Keys rlmesh ignores](#keys-rlmesh-ignores); a config that sets any of them gets one warning at
start-up naming them (`rlmesh config validate` prints it too).

## Every key rlmesh uses

"""


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
    return INTRO + keys_markdown_table(include_compat=True) + "\n" + verl_map_markdown()


def sync(root: Path = REPO_ROOT, check: bool = False) -> list[str]:
    """Returns the files that were (or, with ``check``, would be) changed."""
    changed = []
    for path, new in ((root / "docs" / "config.md", config_doc()),):
        old = path.read_text() if path.exists() else ""
        if old != new:
            changed.append(str(path.relative_to(root)))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(new)
    return changed


if __name__ == "__main__":
    stale = sync(check="--check" in sys.argv)
    print("updated: " + ", ".join(stale) if stale else "config key table is current")
    sys.exit(1 if stale and "--check" in sys.argv else 0)
