"""What the tests share: helper modules, and in ``programs/`` every program a test starts as a
subprocess. Fixtures stay in the ``conftest.py`` files."""
