from rlmesh.config import docs


def test_readme_and_docs_key_tables_are_current():
    stale = docs.sync(check=True)
    assert not stale, f"{stale} out of date: run `make docs`"


def test_readme_section_lists_every_real_key():
    from rlmesh.config import config_keys

    section = docs.readme_section()
    for key in config_keys():
        if not key.compat:
            assert f"`{key.key}`" in section
