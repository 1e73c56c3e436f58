"""Live hyper-parameters: the values in force and their ranges, and changes to them (applied by the
learner at its next step boundary). docs/control.md#live-hyper-parameters"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, create_model

from rlmesh.config.hparams import HPARAMS
from rlmesh.control.deps import API, Strict, audited, plane_of

router = APIRouter(prefix=API, tags=["hyperparams"])


def _hparam_field(name: str) -> Any:
    h = HPARAMS[name]
    bound = {"gt": h.low} if h.low_open else {"ge": h.low}
    return (float | None, Field(None, le=h.high, description=f"{h.what} ({h.key})", **bound))


HyperparamsBody = create_model(  # type: ignore[call-overload]
    "HyperparamsBody", __base__=Strict, **{name: _hparam_field(name) for name in HPARAMS}
)


@router.get("/hyperparams")
async def get_hyperparams(request: Request) -> dict[str, Any]:
    """The values in force (pending changes included) and each one's range and config key."""
    return await plane_of(request).hyperparams()


@router.patch("/hyperparams")
async def set_hyperparams(request: Request, body: HyperparamsBody) -> dict[str, Any]:  # type: ignore[valid-type]
    """Change live hyper-parameters; the learner applies them at its next step boundary.
    Each change is kept in the audit log with its old and new value."""
    values = {k: v for k, v in body.model_dump().items() if v is not None}  # type: ignore[attr-defined]
    return await plane_of(request).set_hyperparams(audited(request, "set_hyperparam"), values)
