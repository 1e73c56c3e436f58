"""The images run as users that are not root (rlmesh's with a fixed uid that owns what it writes),
and Prometheus serves no lifecycle API (/-/quit, /-/reload) a web page could POST to."""

import re

from tests.support.repo import REPO

DEPLOY = REPO / "deploy"


def last_user(dockerfile: str) -> str:
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users, "no USER: the image runs as root"
    return users[-1]


def test_the_rlmesh_image_runs_as_its_own_user_with_a_fixed_uid_owning_runs():
    text = (DEPLOY / "Dockerfile").read_text()
    assert last_user(text).split(":")[0] == "rlmesh"
    uid = re.search(r"^ARG RLMESH_UID=(\d+)$", text, flags=re.MULTILINE)
    assert uid and int(uid.group(1)) >= 1000
    assert '--uid "$RLMESH_UID"' in text and '--gid "$RLMESH_UID"' in text
    assert "chown rlmesh:rlmesh /app/runs" in text
    # USER comes after every step that installs: the code stays root's, read-only to the services.
    assert text.rindex("\nUSER ") > text.rindex("pip install")


def test_prometheus_runs_unprivileged_without_its_lifecycle_api():
    text = (DEPLOY / "prometheus.Dockerfile").read_text()
    assert last_user(text) == "prometheus"
    entrypoint = text[text.index("ENTRYPOINT") :]
    assert "--web.enable-lifecycle" not in entrypoint and "--web.enable-admin-api" not in entrypoint
