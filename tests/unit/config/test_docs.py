from rlmesh.config import docs


def test_the_config_pages_key_table_is_current():
    stale = docs.sync(check=True)
    assert not stale, f"{stale} out of date: run `make docs`"


def test_the_config_page_lists_every_key():
    from rlmesh.config import config_keys

    page = docs.config_doc()
    for key in config_keys():
        assert f"`{key.key}`" in page
