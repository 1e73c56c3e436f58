"""Rebuild this folder from verl's own files: the key=value overrides of verl's example command lines
(lines.yaml) and verl's generated PPO config of each release (generated/<version>.yaml).

Needs a clone of github.com/volcengine/verl (``--repo``, tags v0.5.0... present) for the examples and
the released wheels (``pip download --no-deps verl==X``) for the generated configs; neither is in the
tests' way: the tests read only the files this writes. ``python tests/support/verl_corpus/refresh.py
--repo PATH --wheels DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import subprocess
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).parent
GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"
RELEASES = ("0.5.0", "0.6.1", "0.7.0", "0.9.1")
# (git ref, path): verl's example scripts and quick start, the older release and the newest clone.
EXAMPLES = [
    ("v0.5.0", "docs/start/quickstart.rst"),
    ("v0.5.0", "examples/ppo_trainer/run_deepseek7b_llm.sh"),
    ("v0.5.0", "examples/ppo_trainer/run_qwen2-7b_sglang_seq_balance.sh"),
    ("v0.5.0", "examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh"),
    ("v0.5.0", "examples/grpo_trainer/run_qwen2-7b_math.sh"),
    ("v0.5.0", "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh"),
    ("v0.5.0", "examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh"),
    ("v0.5.0", "examples/rloo_trainer/run_qwen2-7b.sh"),
    ("v0.5.0", "examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh"),
    ("v0.5.0", "recipe/dapo/test_dapo_7b.sh"),
    ("HEAD", "docs/start/quickstart.rst"),
    ("HEAD", "examples/ppo_trainer/run_deepseek7b_llm.sh"),
    ("HEAD", "examples/ppo_trainer/run_gemma.sh"),
    ("HEAD", "examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh"),
    ("HEAD", "examples/ppo_trainer/run_qwen2-7b_sglang_seq_balance.sh"),
    ("HEAD", "examples/grpo_trainer/run_qwen2-7b_math.sh"),
    ("HEAD", "examples/grpo_trainer/run_qwen3-8b.sh"),
    ("HEAD", "examples/grpo_trainer/run_deepseek7b_llm_seq_balance.sh"),
    ("HEAD", "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh"),
    ("HEAD", "examples/rloo_trainer/run_qwen2-7b.sh"),
    ("HEAD", "examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh"),
    ("HEAD", "examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf_baseline.sh"),
    ("HEAD", "examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh"),
    ("HEAD", "examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh"),
    ("HEAD", "examples/gmpo_trainer/run_qwen2_5-7b_math.sh"),
    ("HEAD", "examples/gmpo_trainer/test_dapo_7b_math.sh"),
    ("HEAD", "examples/gspo_trainer/test_gspo_3b_math.sh"),
    ("HEAD", "examples/gpg_trainer/run_qwen2-7b_math.sh"),
]
COMMANDS = ("verl.trainer.main_ppo", "recipe.dapo.main_dapo")
ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
BARE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
ARITH = re.compile(r"\$\(\((.*?)\)\)")
KEY = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_.\-]*=")
# What the scripts leave to the shell that runs them.
SHELL_ENV = {"HOME": "~", "SLURM_JOB_NUM_NODES": "1"}


def _braces(text: str, env: dict[str, str]) -> str:
    """``${NAME}`` and ``${NAME:-default}`` (defaults may nest)."""
    out, i = [], 0
    while i < len(text):
        if not text.startswith("${", i):
            out.append(text[i])
            i += 1
            continue
        depth, j = 1, i + 2
        while j < len(text) and depth:
            if text.startswith("${", j):
                depth, j = depth + 1, j + 2
                continue
            depth -= text[j] == "}"
            j += 1
        name, sep, default = text[i + 2 : j - 1].partition(":-")
        out.append(env[name] if name in env else expand(default.strip("\"'"), env) if sep else f"${{{name}}}")
        i = j
    return "".join(out)


def _arith(text: str, env: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        expr = re.sub(r"\$?\b([A-Za-z_]\w*)\b", lambda n: env.get(n.group(1), n.group(0)), m.group(1))
        try:
            return str(int(eval(expr, {"__builtins__": {}}, {})))  # integers and + - * / only
        except Exception:
            return m.group(0)

    return ARITH.sub(value, text)


def expand(text: str, env: dict[str, str]) -> str:
    text = _braces(_arith(text, env), env)
    return BARE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def overrides(script: str) -> list[str]:
    """The key=value arguments of the script's main_ppo command, its shell variables expanded."""
    env = dict(SHELL_ENV)
    for line in script.replace("\\\n", " ").splitlines():
        if any(c in line for c in COMMANDS):
            words = shlex.split(expand(line, env), comments=True)
            start = next(i for i, w in enumerate(words) if w in COMMANDS)  # not `VAR=1 python3 ...`
            return [w for w in words[start + 1 :] if KEY.match(w)]
        if m := ASSIGN.match(line):
            with contextlib.suppress(ValueError):  # an assignment shlex cannot split is not a knob
                env[m.group(1)] = expand(" ".join(shlex.split(m.group(2), comments=True)), env)
    raise ValueError("no main_ppo command")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="a clone of volcengine/verl with its tags")
    parser.add_argument("--wheels", required=True, help="a folder with verl-X-*.whl for each release")
    args = parser.parse_args()

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", args.repo, *a], capture_output=True, text=True, check=True).stdout

    lines = []
    for ref, path in EXAMPLES:
        commit = git("rev-parse", f"{ref}^{{commit}}").strip()
        lines.append(
            {"source": path, "ref": ref, "commit": commit, "args": overrides(git("show", f"{commit}:{path}"))}
        )
        print(f"{ref} {path}: {len(lines[-1]['args'])} overrides")
    header = "# verl's example command lines (key=value parts), written by refresh.py; do not edit.\n"
    (HERE / "lines.yaml").write_text(header + yaml.safe_dump(lines, sort_keys=False, width=200))
    out = HERE / "generated"
    out.mkdir(exist_ok=True)
    for version in RELEASES:
        wheel = next(Path(args.wheels).glob(f"verl-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            text = z.read(GENERATED).decode()
        (out / f"{version}.yaml").write_text(f"# {GENERATED} of verl {version} ({wheel.name})\n{text}")
        print(f"verl {version}: {GENERATED}")


if __name__ == "__main__":
    main()
