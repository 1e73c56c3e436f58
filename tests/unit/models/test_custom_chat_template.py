"""actor_rollout_ref.model.custom_chat_template replaces the tokenizer's chat template where prompts
are rendered: the learner's training and validation prompts."""

from __future__ import annotations

import pytest

from rlmesh.config import ConfigError, load_config
from rlmesh.data import RLHFDataset
from rlmesh.models import CHAT_TEMPLATE, build_tokenizer, load_tokenizer
from tests.support.data import row, write

# Plain "Q:/A:" turns instead of the tokenizer's ChatML.
TEMPLATE = (
    "{%- for message in messages %}{{ message['role'] | upper }}: {{ message['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}ASSISTANT:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}]


def rendered(messages: list[dict[str, str]]) -> str:
    """TEMPLATE by hand."""
    return "".join(f"{m['role'].upper()}: {m['content']}\n" for m in messages) + "ASSISTANT:"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def test_load_tokenizer_replaces_the_chat_template(tokenizer_dir):
    own = load_tokenizer(tokenizer_dir)
    assert own.chat_template == CHAT_TEMPLATE
    custom = load_tokenizer(tokenizer_dir, chat_template=TEMPLATE)
    text = custom.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == rendered(MESSAGES)
    assert text != own.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def test_dataset_prompts_are_rendered_with_the_custom_template(tmp_path, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir, chat_template=TEMPLATE)
    ds = RLHFDataset(write(tmp_path / "a.parquet", [row(MESSAGES)]), tok)
    assert ds[0].prompt_text == rendered(MESSAGES)
    assert tok.decode(ds[0].prompt_ids) == rendered(MESSAGES)


def test_the_learner_renders_training_and_validation_prompts_with_it(tmp_path, tokenizer_dir):
    from rlmesh.learner.run.loop import TrainingLoop

    train = write(tmp_path / "train.parquet", [row(MESSAGES)] * 4)
    val = write(tmp_path / "val.parquet", [row([{"role": "user", "content": "2+2?"}])])
    (tmp_path / "config.yaml").write_text(
        "actor_rollout_ref:\n  model:\n    custom_chat_template: |-\n"
        + "".join(f"      {line}\n" for line in TEMPLATE.splitlines())
    )
    cfg = load_config(
        tmp_path / "config.yaml",
        [
            f"actor_rollout_ref.model.path={tokenizer_dir}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"trainer.default_local_dir={tmp_path / 'out'}",
            "trainer.logger=[]",
            "trainer.device=cpu",
        ],
    )
    assert cfg.actor_rollout_ref.model.custom_chat_template == TEMPLATE
    loop = TrainingLoop(cfg, lambda cfg, steps: None)
    try:
        assert loop.train_set[0].prompt_text == rendered(MESSAGES)
        assert loop.tokenizer.decode(loop.train_set[0].prompt_ids) == rendered(MESSAGES)
        assert loop.val_set[0].prompt_text == "USER: 2+2?\nASSISTANT:"
    finally:
        loop.sinks.close()


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% for m in messages %}{{ m }", "unexpected '}'"),
        ("{% if messages %}x", "Unexpected end of template"),
    ],
)
def test_a_template_that_does_not_compile_fails_at_config_load(template, error):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"actor_rollout_ref.model.custom_chat_template='{template}'"])
    (problem,) = info.value.problems
    assert "'actor_rollout_ref.model.custom_chat_template'" in problem
    assert "not a valid Jinja chat template" in problem and error in problem


def test_the_default_keeps_the_tokenizers_template():
    assert load_config(None, []).actor_rollout_ref.model.custom_chat_template is None
