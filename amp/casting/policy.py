"""Which run's casting rules the O1/O4 patches apply at this moment.

The patches are process-wide (one installation, kept while any O1/O4 run may be live), but each
``amp.initialize`` call has its own policy: a :class:`RunPolicy` (O1: fp16, O4: bf16, with its own
weight-cast cache; the run's ``AmpHandle`` in ``patcher.py`` is one) or ``None`` (O0, O2, O3, O5:
no casts). Every wrapper reads ``current`` on each call, one module attribute, because patched
functions run many times per forward.

Every model an enabled ``initialize`` returns makes its run's policy current while its forward
runs and restores the previous one afterwards, also when the forward raises, so the innermost
amp model wins (a teacher called inside a student's forward computes as its own level says).
Outside every amp model's forward the latest ``initialize``'s policy applies.

``current`` is not thread-local: a thread-local read would cost every patched call and cannot be
traced by torch.compile. So a model whose forward starts while another thread is inside the
forward of a model that casts differently raises instead of computing at the wrong level; models
that cast alike may run forward in several threads at once.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Literal, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._compat import is_compiling
from ._cast import CastCache

__all__ = ["RunPolicy", "current", "DISABLED", "set_outside", "outside", "casts_to", "track",
           "disabled", "restore", "in_disable_casts"]

current: Policy | None = None
# The policies that enclosing forwards (and the outside) will get back, innermost last.
_outer: list[Policy | None] = []
# The thread that entered the outermost running amp forward.
_owner: int | None = None
# Open disable_casts blocks (of any thread), and the policy the last one to close restores.
_disabled_depth = 0
_policy_before_disabled: Policy | None = None
_disabled_lock = threading.Lock()


class RunPolicy:
    """One O1/O4 run's casting rules, as the patches read them, and its weight-cast cache.

    ``cache`` maps each fp32 Parameter cast to low precision in the current iteration to
    ``(cast copy, parameter version at cast time)``; ``_clear_cache()`` empties it (amp does so
    at every ``scale_loss`` exit). A copy of a model (``deepcopy``) shares its run's policy; a
    pickled one carries the settings and starts with an empty cache.
    """

    def __init__(self, patch_type: torch.dtype, allow_banned: bool = False, verbose: bool = False,
                 enable_caching: bool = True) -> None:
        self._enable_caching = enable_caching
        self._verbose = verbose
        self.allow_banned = allow_banned
        self.patch_type = patch_type
        self._cache: CastCache = {}
        self._is_active = True

    def __deepcopy__(self, memo: dict[int, Any]) -> RunPolicy:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_cache": {}}

    def is_active(self) -> bool:
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        previous = self._is_active
        self._is_active = False
        try:
            yield
        finally:
            self._is_active = previous

    def _clear_cache(self) -> None:
        self._cache.clear()

    def remove_cache(self, param: nn.Parameter) -> None:
        self._cache.pop(param, None)

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> CastCache:
        return self._cache

    @property
    def verbose(self) -> bool:
        return self._verbose


class _Disabled:
    """The policy inside ``amp.disable_casts()``: nothing is cast, but fp16/bf16 arguments to
    in-place fp32 functions and banned functions are still refused, as under an active run."""
    # Never active (Literal, so that an active policy is known to be a RunPolicy).
    _is_active: Literal[False] = False
    patch_type = None
    allow_banned = False


DISABLED = _Disabled()
# What ``current`` holds besides None (no casts): a run's policy, or DISABLED.
Policy = Union[RunPolicy, _Disabled]


def set_outside(policy: Policy | None) -> None:
    """Make ``policy`` the one that applies outside every amp model's forward."""
    global current
    if _outer:
        _outer[0] = policy
    else:
        current = policy


def outside() -> Policy | None:
    return _outer[0] if _outer else current


def casts_to(policy: Policy | None) -> torch.dtype | None:
    """What ``policy`` casts to (None: nothing)."""
    return policy.patch_type if policy is not None and policy._is_active else None


def _enter_forward(policy: Policy | None, module: nn.Module, args: tuple[Any, ...]) -> None:
    global current, _owner
    # Saved first: the forward hook restores it even when this hook raises.
    _outer.append(current)
    if not is_compiling():
        thread = threading.get_ident()
        if len(_outer) == 1:
            _owner = thread
        elif thread != _owner and casts_to(current) is not casts_to(policy):
            raise RuntimeError(
                f"{type(module).__name__}'s forward (amp casts: {casts_to(policy)}) started while "
                f"another thread runs the forward of an amp model that casts to "
                f"{casts_to(current)}. The O1/O4 casting policy is process-wide, not per thread: "
                "run these models' forwards in one thread, or initialize them at one opt level.")
    # Inside disable_casts, an O1/O4 model does not turn its casts back on.
    current = DISABLED if policy is not None and current is DISABLED else policy


def _exit_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    global current
    current = _outer.pop()


def track(model: nn.Module, policy: Policy | None) -> list[RemovableHandle]:
    """Run ``model``'s forward (its forward hooks included) under ``policy``; returns the hooks' handles."""
    return [model.register_forward_pre_hook(functools.partial(_enter_forward, policy), prepend=True),
            model.register_forward_hook(_exit_forward, always_call=True)]


def disabled() -> Policy | None:
    """Enter ``disable_casts``: return what to restore with ``restore``.

    Blocks may overlap across threads (two threads' ``optimizer.step()``, each run with casts
    off): only the outermost block saves the policy and only the last one to leave restores it, so
    one thread leaving cannot switch casts off for good or on under the other.
    """
    global current, _disabled_depth, _policy_before_disabled
    with _disabled_lock:
        if _disabled_depth == 0:
            _policy_before_disabled = current
            if current is not None:
                current = DISABLED
        _disabled_depth += 1
    return _policy_before_disabled


def in_disable_casts() -> bool:
    """Whether a ``disable_casts`` block is open (in any thread), at any opt level."""
    return _disabled_depth > 0


def restore(previous: Policy | None) -> None:
    """Leave a ``disable_casts`` block entered with ``disabled``."""
    global current, _disabled_depth
    with _disabled_lock:
        _disabled_depth -= 1
        if _disabled_depth == 0:
            current = _policy_before_disabled
