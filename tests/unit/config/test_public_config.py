"""One public form of a config for every place it is shown or stored: the token, any leaf named like
a secret, and passwords inside URLs masked; the rest, token counts included, kept."""

import yaml

from rlmesh.config import load_config
from rlmesh.config.loader import dump_public_yaml
from rlmesh.config.secrets import is_secret_key, public_config, redact_argv, redact_url

TOKEN = "tok-0123456789abcdef"
REDIS_PW = "redis-pw-a1b2c3"
PROM_PW = "prom-pw-d4e5f6"


def secret_config():
    return load_config(
        None,
        [
            f"rlmesh.auth_token={TOKEN}",
            f"rlmesh.redis_url=redis://rlmesh:{REDIS_PW}@10.0.0.5:6379/0",
            f"rlmesh.control.prometheus_url=http://admin:{PROM_PW}@prometheus:9090",
            "+custom_reward_function.reward_kwargs.judge_api_key=sk-judge",
            "+custom_reward_function.reward_kwargs.hf_token=hf-abc",
            "+custom_reward_function.reward_kwargs.max_tokens=64",
        ],
    )


def test_every_secret_of_a_config_is_masked_and_nothing_else():
    public = public_config(secret_config())
    text = yaml.safe_dump(public)
    for secret in (TOKEN, REDIS_PW, PROM_PW, "sk-judge", "hf-abc"):
        assert secret not in text
    assert public["rlmesh"]["auth_token"] == "***"
    assert public["rlmesh"]["redis_url"] == "redis://rlmesh:***@10.0.0.5:6379/0"
    assert public["rlmesh"]["control"]["prometheus_url"] == "http://admin:***@prometheus:9090"
    kwargs = public["custom_reward_function"]["reward_kwargs"]
    assert kwargs == {"judge_api_key": "***", "hf_token": "***", "max_tokens": 64}
    # Counts of tokens are no secrets.
    assert public["actor_rollout_ref"]["rollout"]["max_num_batched_tokens"] == 8192
    assert public["data"]["max_prompt_length"] == secret_config().data.max_prompt_length


def test_the_public_yaml_holds_no_secret_and_loads_again(tmp_path):
    text = dump_public_yaml(secret_config())
    for secret in (TOKEN, REDIS_PW, PROM_PW, "sk-judge", "hf-abc"):
        assert secret not in text
    path = tmp_path / "config.yaml"
    path.write_text(text)
    again = load_config(path, [])  # e.g. `rlmesh export` reads a checkpoint's copy
    assert again.rlmesh.token() == "***" and again.rlmesh.redis_url == "redis://rlmesh:***@10.0.0.5:6379/0"
    assert public_config(again) == public_config(secret_config())


def test_the_typed_config_never_shows_the_token():
    cfg = secret_config()
    shown = [
        repr(cfg),
        str(cfg),
        str(cfg.rlmesh),
        f"{cfg.rlmesh}",
        str(cfg.model_dump()),
        cfg.model_dump_json(),
        yaml.safe_dump(cfg.model_dump(mode="json")),
    ]
    for text in shown:
        assert TOKEN not in text
    assert cfg.model_dump(mode="json")["rlmesh"]["auth_token"] == "**********"
    assert public_config(cfg)["rlmesh"]["auth_token"] == "***"
    assert cfg.rlmesh.token() == TOKEN  # asked for by name, it is there
    assert load_config(None, []).rlmesh.token() == ""


def test_unset_secrets_stay_unset():
    public = public_config({"rlmesh": {"auth_token": None, "x": {"password": "", "api_key": "k"}}})
    assert public == {"rlmesh": {"auth_token": None, "x": {"password": "", "api_key": "***"}}}


def test_which_keys_are_secret():
    secret = ["rlmesh.auth_token", "a.token", "a.hf_token", "a.redis_password", "a.client_secret", "a.apikey",
              "a.API_KEY", "a.credentials", "+a.passwd"]  # fmt: skip
    public = ["a.max_tokens", "a.max_num_batched_tokens", "a.tokenizer", "a.skip_tokenizer_init",
              "a.token_budget", "a.prompt_key", "data.tokenizer"]  # fmt: skip
    assert [k for k in secret if not is_secret_key(k)] == []
    assert [k for k in public if is_secret_key(k)] == []


def test_url_passwords_are_masked_whatever_they_contain():
    assert redact_url("http://u:p@ss@host:1/x") == "http://u:***@host:1/x"  # an unencoded @
    assert redact_url("redis://:pw@h/0") == "redis://:***@h/0"
    assert redact_url("redis://h:6379/0?password=pw&db=1") == "redis://h:6379/0?password=***&db=1"
    assert redact_url("http://h/?access_token=abc") == "http://h/?access_token=***"
    assert redact_url("http://h:8080/path and mail@example.org") == "http://h:8080/path and mail@example.org"


def test_a_token_count_override_stays_readable_in_a_log_line():
    assert redact_argv(["actor_rollout_ref.rollout.max_num_batched_tokens=8192", "rlmesh.auth_token=x"]) == [
        "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
        "rlmesh.auth_token=***",
    ]
