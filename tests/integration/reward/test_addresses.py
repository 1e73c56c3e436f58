"""The reward address list in a real Redis: with the run's token it is signed when set, and a
client follows only a list the run signed whose every entry is a service's address; anything else
reads as no list (the configured addresses), so the token is never sent where a forger points."""

import json

import pytest

from rlmesh.control.fleet import reward_addresses, set_rewards
from rlmesh.queue import RunKeys
from rlmesh.queue.signing import BAD_SIGNATURE, INVALID, SIGNED_PREFIX, UNSIGNED, UNTRUSTED, signer_for
from rlmesh.reward.addresses import (
    get_reward_addresses,
    reward_address_source,
    reward_addresses_key,
    set_reward_addresses,
)

TOKEN = "reward-list-token-9a"
CONFIGURED = ["127.0.0.1:50051"]


async def test_a_signed_list_is_followed_and_a_forged_one_never(redis, keys):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    source = reward_address_source(redis, signed, fallback=CONFIGURED, cache_s=0)
    assert await source.addresses() == CONFIGURED
    await set_rewards(redis, signed, ["127.0.0.1:50061", "reward-b:50051"])
    raw = await redis.get(reward_addresses_key(keys))
    assert raw.startswith(SIGNED_PREFIX) and TOKEN.encode() not in raw
    assert await source.addresses() == ["127.0.0.1:50061", "reward-b:50051"]
    assert await reward_addresses(redis, signed, CONFIGURED) == (
        ["127.0.0.1:50061", "reward-b:50051"],
        "redis",
    )

    counts = {c: UNTRUSTED.total("reward_addresses", c) for c in (BAD_SIGNATURE, UNSIGNED, INVALID)}
    # Someone with Redis but without the token lists their own host: signed with another key...
    await set_reward_addresses(redis, RunKeys(keys.run_id, signer_for("guess", keys.run_id)), ["10.6.6.6:1"])
    assert await source.addresses() == CONFIGURED
    assert await get_reward_addresses(redis, signed) is None
    # ... unsigned (the JSON as it was written before lists were signed) ...
    await redis.set(reward_addresses_key(keys), json.dumps(["10.6.6.6:1"]))
    assert await source.addresses() == CONFIGURED
    assert await reward_addresses(redis, signed, CONFIGURED) == (CONFIGURED, "config")
    # ... or a copy of the signed value with bytes changed.
    await redis.set(reward_addresses_key(keys), raw.replace(b"50061", b"50066"))
    assert await source.addresses() == CONFIGURED
    assert UNTRUSTED.total("reward_addresses", BAD_SIGNATURE) >= counts[BAD_SIGNATURE] + 3
    assert UNTRUSTED.total("reward_addresses", UNSIGNED) >= counts[UNSIGNED] + 2


async def test_a_signed_list_that_names_no_service_is_not_followed(redis, keys):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    source = reward_address_source(redis, signed, fallback=CONFIGURED, cache_s=0)
    with pytest.raises(ValueError):  # refused when set ...
        await set_reward_addresses(redis, signed, ["169.254.169.254:80"])
    # ... and when read, should a holder of the token have written one anyway.
    key = reward_addresses_key(keys)
    for listed in (["169.254.169.254:80"], ["127.0.0.1:50061", "[fe80::1]:80"], {"a": 1}):
        payload = json.dumps(listed).encode()
        await redis.set(key, SIGNED_PREFIX + signed.signer.tag(key, payload) + payload)
        before = UNTRUSTED.total("reward_addresses", INVALID)
        assert await source.addresses() == CONFIGURED
        assert UNTRUSTED.total("reward_addresses", INVALID) == before + 1


async def test_without_a_token_the_list_works_as_before(redis, keys):
    source = reward_address_source(redis, keys.run_id, fallback=CONFIGURED, cache_s=0)
    await set_reward_addresses(redis, keys.run_id, ["127.0.0.1:50062"])
    assert json.loads(await redis.get(reward_addresses_key(keys))) == ["127.0.0.1:50062"]
    assert await source.addresses() == ["127.0.0.1:50062"]
    await redis.set(reward_addresses_key(keys), b"\x00\xff not json")
    assert await source.addresses() == CONFIGURED  # never an exception in the client
    await set_reward_addresses(redis, keys.run_id, [])
    assert await get_reward_addresses(redis, keys.run_id) is None
