"""The engine's request parsing, in process: what the HTTP tests pin, at the edges."""

import asyncio

import pytest
from starlette.requests import Request

from rlmesh.engine.protocol import body_of, check_generate_limits, parse_input_ids
from rlmesh.engine.sampling import parse_sampling_params


def request(body: bytes) -> Request:
    headers = [(b"content-length", str(len(body)).encode())]

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def test_input_ids_one_prompt_or_a_batch():
    assert parse_input_ids({"input_ids": [1, 2]}, 10) == ([[1, 2]], False)
    assert parse_input_ids({"input_ids": [[1], [2, 3]]}, 10) == ([[1], [2, 3]], True)
    with pytest.raises(ValueError, match=r"input_ids\[0\]=True"):
        parse_input_ids({"input_ids": [True]}, 10)  # bool is an int to Python, not a token id
    with pytest.raises(ValueError, match=r"input_ids\[1\]: expected a non-empty list"):
        parse_input_ids({"input_ids": [[1], []]}, 10)


def test_limits_allow_exactly_the_context():
    params = parse_sampling_params({"max_new_tokens": 6})
    check_generate_limits([[1] * 4], params, False, context=10)
    with pytest.raises(ValueError, match=r"^input_ids: 5 tokens"):
        check_generate_limits([[1] * 5], params, False, context=10)


def test_body_of_names_missing_fields_and_what_is_not_an_object():
    assert asyncio.run(body_of(request(b'{"a": 1}'), "a")) == {"a": 1}
    assert asyncio.run(body_of(request(b""))) == {}
    with pytest.raises(ValueError, match=r"missing fields \['b'\]"):
        asyncio.run(body_of(request(b'{"a": 1}'), "a", "b"))
    with pytest.raises(ValueError, match="must be a JSON object"):
        asyncio.run(body_of(request(b"[1]")))
