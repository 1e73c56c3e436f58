"""The Rollout service's ``UpdateWeightsFromDistributedRequest.load_format``, as its engine gets it."""

import pytest

from rlmesh_services.rollout.servicer import engine_load_format


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", None), ("per_tensor", None), ("flattened_bucket", "flattened_bucket")],
)
def test_known_formats_map_to_the_engines_load_format(value, expected):
    assert engine_load_format(value) == expected


@pytest.mark.parametrize("value", ["direct", "FLATTENED_BUCKET", "None"])
def test_an_unknown_format_is_refused_naming_it_and_the_known_ones(value):
    with pytest.raises(ValueError) as e:
        engine_load_format(value)
    assert str(e.value) == f"unknown load_format {value!r}; known: '', 'per_tensor', 'flattened_bucket'"
