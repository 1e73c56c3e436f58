"""The control plane (``rlmesh serve control``): a REST API over a running job, the audit log of
what it changed, opt-in automatic responses, and ``rlmesh ctl``, its command line. docs/control.md"""

from rlmesh.control.app import create_app

__all__ = ["create_app"]
