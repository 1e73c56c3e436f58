"""Package discovery for the two source roots: ``libs/rlmesh`` (import ``rlmesh``) and
``services/`` (import ``rlmesh_services``). Everything else lives in pyproject.toml."""

from setuptools import find_packages, setup

packages = find_packages("libs", include=["rlmesh", "rlmesh.*"])
packages += ["rlmesh_services"] + [f"rlmesh_services.{p}" for p in find_packages("services")]

setup(
    packages=packages,
    package_dir={"rlmesh": "libs/rlmesh", "rlmesh_services": "services"},
    package_data={
        "rlmesh": ["py.typed", "job/*.yaml", "control/static/*", "control/static/vendor/*"],
        "rlmesh_services": ["*/*.yaml"],
    },
)
