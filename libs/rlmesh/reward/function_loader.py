"""Loading the configured reward function, checked once at start-up: a built-in, or the user's
``custom_reward_function.path`` (a file, ``pkg.module:fn``, ``pkg.module``, ``pkg://pkg.module``)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rlmesh.reward.builtin import BUILTIN_FUNCTIONS

if TYPE_CHECKING:
    from rlmesh.config import CustomRewardFunctionConfig

# Keyword arguments every reward function is called with (verl's naive reward manager does the same).
REWARD_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionLoadError(ValueError):
    """A configured reward function cannot be used; the message says which and why."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward function ready to call: ``call(data_source, solution_str, ground_truth, extra_info)``."""

    name: str
    fn: Callable[..., Any]
    is_async: bool
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def call(self, data_source: str, solution_str: str, ground_truth: str, extra_info: Any) -> Any:
        """Calls the function (for an async one: returns its coroutine)."""
        return self.fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **self.kwargs,
        )

    def source_file(self) -> str | None:
        """The file the function is defined in (a callable object's: its class's), None when Python
        cannot tell (a C function, a ``functools.partial``)."""
        target = inspect.unwrap(self.fn)
        for candidate in (target, type(target)):
            try:
                return inspect.getsourcefile(candidate)
            except TypeError:
                continue
        return None


def builtin_function(name: str) -> RewardFunction:
    """A built-in by name (``gsm8k``, ``math``, ``math_dapo``, ``arithmetic``)."""
    if name not in BUILTIN_FUNCTIONS:
        raise RewardFunctionLoadError(
            f"unknown built-in reward function {name!r}; known: {', '.join(sorted(BUILTIN_FUNCTIONS))}"
        )
    return RewardFunction(name=name, fn=BUILTIN_FUNCTIONS[name], is_async=False)


def _looks_like_file(path: str) -> bool:
    return path.endswith(".py") or "/" in path or "\\" in path or Path(path).expanduser().is_file()


def _import_module(module_name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RewardFunctionLoadError(
            f"{what}: cannot import module {module_name!r} ({e}); is its package on PYTHONPATH?"
        ) from e
    except Exception as e:
        raise RewardFunctionLoadError(
            f"{what}: importing module {module_name!r} raised {type(e).__name__}: {e}"
        ) from e


def _load_file(path: str, what: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise RewardFunctionLoadError(f"{what}: no such file {str(file)!r}")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
    module_name = f"rlmesh_custom_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardFunctionLoadError(f"{what}: {str(file)!r} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardFunctionLoadError(
            f"{what}: running {str(file)!r} raised {type(e).__name__}: {e}{_import_site(e, str(file))}"
        ) from e
    return module


def _import_site(e: Exception, file: str) -> str:
    """``, at file:line`` of the line of ``file`` that failed while it was imported."""
    from rlmesh.reward.frames import raise_site, user_frames

    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f", at {e.filename}:{e.lineno}"
    site = raise_site(user_frames(e, file), file)
    return f", at {site}" if site else ""


def _is_async(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


def check_signature(fn: Callable[..., Any], kwargs: Mapping[str, Any], what: str) -> None:
    """Raises unless ``fn`` accepts verl's reward arguments (by keyword) plus ``kwargs``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables without a signature: trust them
    try:
        sig.bind(**dict.fromkeys(REWARD_ARGUMENTS), **kwargs)
    except TypeError as e:
        extra = f" plus reward_kwargs {sorted(kwargs)}" if kwargs else ""
        raise RewardFunctionLoadError(
            f"{what}: signature {sig} does not fit: it must accept the keyword arguments "
            f"{', '.join(REWARD_ARGUMENTS)}{extra} (verl's compute_score(data_source, solution_str, "
            f"ground_truth, extra_info=None)); {e}{_defined_at(fn)}"
        ) from e


def _defined_at(fn: Callable[..., Any]) -> str:
    """``; defined at file:line`` where ``fn`` is, empty when Python cannot tell."""
    try:
        target = inspect.unwrap(fn)
        file, line = inspect.getsourcefile(target), inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return ""
    return f"; defined at {file}:{line}" if file else ""


def load_reward_function(
    path: str, name: str | None = "compute_score", reward_kwargs: Mapping[str, Any] | None = None
) -> RewardFunction:
    """Resolves ``path`` (+ ``name``) to a checked ``RewardFunction`` (see the module docstring)."""
    kwargs = dict(reward_kwargs or {})
    spec = path.strip()
    if not spec:
        raise RewardFunctionLoadError("custom_reward_function.path is empty")
    what = f"custom_reward_function.path={spec!r}"
    if spec.startswith("pkg://"):
        spec = spec[len("pkg://") :]
        file_based = False
    else:
        file_based = ":" not in spec and _looks_like_file(spec)
    if file_based:
        module = _load_file(spec, what)
        module_label, attr = spec, name
    else:
        module_name, sep, attr_part = spec.partition(":")
        attr = attr_part if sep else name
        if not module_name or (sep and not attr_part):
            raise RewardFunctionLoadError(f"{what}: expected 'package.module:function'")
        module = _import_module(module_name, what)
        module_label = module_name
    if not attr:
        raise RewardFunctionLoadError(f"{what}: no function name (custom_reward_function.name is empty)")
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardFunctionLoadError(
                f"{what}: module {module_label!r} has no attribute {attr!r}; its callables: "
                f"{', '.join(public) or 'none'}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardFunctionLoadError(f"{what}: {attr!r} is a {type(fn).__name__}, not a function")
    check_signature(fn, kwargs, what)
    return RewardFunction(name=f"{module_label}:{attr}", fn=fn, is_async=_is_async(fn), kwargs=kwargs)


def configured_function(custom: CustomRewardFunctionConfig, forced: str | None) -> RewardFunction | None:
    """The function for every sample: the ``forced`` built-in or ``custom_reward_function``; None when
    neither is set (then each sample's ``data_source`` picks a built-in)."""
    if forced:
        if custom.path:
            raise RewardFunctionLoadError(
                f"a forced built-in ({forced!r}) and custom_reward_function.path={custom.path!r} are "
                "both set; choose one"
            )
        return builtin_function(forced)
    if custom.path:
        return load_reward_function(custom.path, custom.name, custom.reward_kwargs)
    return None
