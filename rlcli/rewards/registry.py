"""Reward functions by name, and user reward functions by ``module:function`` or file path.

Every reward function has verl's signature, called with keywords::

    compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None)
        -> float | dict   # a dict carries "score" plus extra fields such as "acc"

Specs accepted by ``resolve_reward_fn``: a registered name (``gsm8k``, ``math``, ``arith``,
``default``), ``package.module:function``, or ``path/to/file.py:function``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from algorithms.registry import Registry
from rlcli.errors import UserError
from rlcli.plugins import is_user_spec, load_user_object

RewardFn = Callable[..., Any]

_USER_SPECS = ", or 'module:function', or 'path/to/file.py:function'"
REWARDS: Registry[RewardFn] = Registry("reward function", error=UserError, alternatives=_USER_SPECS)
# Builtins known to return quickly; the RewardManager calls them in the trainer's own process.
_IN_PROCESS: set[RewardFn] = set()


def register_reward(name: str, *, in_process: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``.

    ``in_process=True`` promises the function is fast and always returns (no user code, no
    unbounded work): the ``RewardManager`` then skips its worker processes for it.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        REWARDS.register(name)(fn)
        if in_process:
            _IN_PROCESS.add(fn)
        return fn

    return decorate


# The reward function registered under a name; UserError listing the valid names otherwise.
get_reward_fn = REWARDS.lookup


class RewardFunction:
    """A resolved reward spec, callable with verl's signature.

    Pickles as its spec, so worker processes re-resolve it: this is what lets a function loaded
    from a file path (which no worker could import by module name) run in a worker process.
    """

    def __init__(self, spec: str, fn: RewardFn, kwargs: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self.fn = fn
        self.kwargs = dict(kwargs or {})

    @property
    def in_process(self) -> bool:
        """True for the registered builtins that are safe to call in the trainer's process."""
        return is_in_process_reward(self.fn)

    def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict[str, Any] | None = None,
    ) -> float | dict[str, Any]:
        return self.fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **self.kwargs,
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return resolve_reward_fn, (self.spec, self.kwargs)

    def __repr__(self) -> str:
        extra = f", {self.kwargs}" if self.kwargs else ""
        return f"RewardFunction({self.spec!r}{extra})"


def is_in_process_reward(fn: RewardFn) -> bool:
    """Whether ``fn`` (or the function a partial / RewardFunction wraps) is an in-process builtin."""
    while True:
        if isinstance(fn, RewardFunction):
            fn = fn.fn
        elif isinstance(fn, functools.partial):
            fn = fn.func
        else:
            return fn in _IN_PROCESS


def resolve_reward_fn(spec: str, reward_kwargs: Mapping[str, Any] | None = None) -> RewardFunction:
    """Resolve a registered name, ``module:function`` or ``path/to/file.py:function``.

    ``reward_kwargs`` are passed to every call (e.g. ``{"method": "flexible"}`` for gsm8k).
    Raises ``UserError`` naming the spec and the import error when it does not resolve.
    """
    if spec in REWARDS or not is_user_spec(spec):
        return RewardFunction(spec, REWARDS.lookup(spec), reward_kwargs)
    fn, spec = load_user_object(spec, "reward function", "function")
    if not callable(fn):
        raise UserError(f"reward function {spec!r} is not a function")
    return RewardFunction(spec, fn, reward_kwargs)
