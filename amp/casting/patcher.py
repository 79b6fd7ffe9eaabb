"""The O1/O4 function patcher: ``init`` installs the patches, ``deactivate`` removes them.

``init`` is Apex's ``amp.init``; ``amp.initialize`` calls it for O1 (``patch_type=torch.float16``)
and O4 (``torch.bfloat16``) and returns its ``AmpHandle``, which records the patches. Each handle
is also its run's casting policy (``policy.RunPolicy``, with its weight-cast cache): the patches
are installed once and read the current policy, so a later ``init`` takes the installed patches
over (with the user registrations they carry) instead of changing an earlier run's models. The
latest ``init``'s handle is kept here (``installed_handle``; Apex's ``amp._amp_state.handle``).
Differences from Apex, on purpose: ``_deactivate`` restores every patched attribute, the RNN
``_VF`` shim included, in reverse order, and turns the handle (and so the decorators) off, and
``deactivate`` (``amp.deactivate()``) is its public form; ``disable_casts`` is exception safe and
a no-op without a handle; a ``register_*_function`` call takes effect at once on the installed
patches.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NoReturn

import torch

from .._logging import logger
from . import lists, policy, registry, rnn
from .policy import RunPolicy
from .registry import Registration, consume_registry
from .wrap import (Function, make_banned_wrapper, make_cast_wrapper, make_error_if_any_low_precision,
                   make_error_if_self_low_precision, make_match_self_wrapper,
                   make_promote_wrapper, make_sequence_promote_wrapper)

__all__ = ["AmpHandle", "NoOpHandle", "init", "deactivate", "disable_casts", "use_run_policy",
           "installed_handle", "set_installed_handle", "register_half_function",
           "register_float_function", "register_bfloat16_function", "register_promote_function"]

_OLD_API_ERROR = (
    "The old Amp API (amp.init() + handle.scale_loss / handle.wrap_optimizer) is no longer "
    "supported. Use `model, optimizer = amp.initialize(model, optimizer, opt_level=\"O1\")` and "
    "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`.")
_MISSING = object()

# The handle of the latest ``init`` (Apex's ``amp._amp_state.handle``): its patches are installed.
_installed: AmpHandle | NoOpHandle | None = None

if TYPE_CHECKING:
    from ..options import Options


class AmpHandle(RunPolicy):
    """One O1/O4 installation: the run's casting policy (``policy.RunPolicy``) and the patches it made.

    A pickled handle carries the settings and starts with no patches.
    """

    def __init__(self, loss_scale: float | str = "dynamic", enable_caching: bool = True,
                 verbose: bool = False, allow_banned: bool = False,
                 patch_type: torch.dtype = torch.float16) -> None:
        super().__init__(patch_type, allow_banned, verbose, enable_caching)
        self.loss_scale = loss_scale
        # (owner, name, the entry it had before, or _MISSING), in patching order.
        self._all_wrappers: list[tuple[Any, str, Any]] = []
        # The user registrations the installed patches carry, in installation order.
        self._registered: list[Registration] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_all_wrappers": [], "_registered": []}

    def wrap_optimizer(self, optimizer: Any, num_loss: int = 1) -> NoReturn:
        raise RuntimeError(_OLD_API_ERROR)

    def scale_loss(self, loss: Any, optimizer: Any) -> NoReturn:
        raise RuntimeError(_OLD_API_ERROR)

    def _save_func(self, owner: Any, name: str, new: Any) -> None:
        """Install ``new`` as ``owner.name``, remembering the exact previous entry."""
        self._all_wrappers.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, new)

    def _uninstall(self) -> None:
        """Restore every patched attribute to the object it was before the patches."""
        # Reverse order, so a name patched twice ends up on the original, not the first wrapper.
        for owner, name, previous in reversed(self._all_wrappers):
            if previous is _MISSING:
                delattr(owner, name)  # it was inherited (e.g. Tensor.add from TensorBase)
            else:
                setattr(owner, name, previous)
        self._all_wrappers = []

    def _apply_registrations(self) -> None:
        """Reinstall the patches with the pending user registrations (innermost, as at ``init``)."""
        if self._all_wrappers:
            _reinstall(self, self._registered + consume_registry())

    def _deactivate(self) -> None:
        """Restore every patched attribute and turn this run's casts off."""
        self._uninstall()
        self._registered = []
        self._is_active = False
        self._cache.clear()
        if policy.outside() is self:
            policy.set_outside(None)


class NoOpHandle:
    """The handle of ``init(enabled=False)``: nothing is patched or cast."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def wrap_optimizer(self, optimizer: Any, num_loss: int = 1) -> NoReturn:
        raise RuntimeError(_OLD_API_ERROR)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    def _apply_registrations(self) -> None:
        pass


def _wrap(handle: AmpHandle, module: Any, names: Iterable[str], make: Callable[..., Function],
          *extra: Any) -> None:
    for name in names:
        handle._save_func(module, name, make(getattr(module, name), name, *extra))


def _inplace(module: Any, names: Iterable[str]) -> list[str]:
    return [n + "_" for n in names if hasattr(module, n + "_")]


def _install(handle: AmpHandle, registered: Iterable[Registration]) -> None:
    # The fp16 lists, a superset of the bf16 ones: every wrapper reads the current policy, so
    # one installation serves O1 and O4 runs alike.
    # User registrations first, so they end up innermost and override the lists below; the
    # latest registration of a name replaces the earlier ones.
    latest: dict[tuple[object, str], torch.dtype | None] = {}
    for module, name, dtype in registered:
        latest.pop((module, name), None)
        latest[module, name] = dtype
    for (module, name), dtype in latest.items():
        if dtype is None:
            _wrap(handle, module, [name], make_promote_wrapper)
        else:
            _wrap(handle, module, [name], make_cast_wrapper, dtype, dtype is not torch.float32)
    handle._registered = [(module, name, dtype) for (module, name), dtype in latest.items()]
    functional, torch_lists, tensor_lists = lists.overrides(torch.float16)
    for ovr in (functional, torch_lists, tensor_lists):
        for name in ovr.low_precision:
            only = torch.float16 if name in lists.TORCH_BF16_EXCLUDED else None
            _wrap(handle, ovr.module, [name], make_cast_wrapper, None, True, only)
        _wrap(handle, ovr.module, ovr.fp32, make_cast_wrapper, torch.float32, False)
    for ovr in (torch_lists, tensor_lists):
        for name in ovr.promote:
            _wrap(handle, ovr.module, [name], make_promote_wrapper, name in lists.NATIVE_PROMOTE)
        _wrap(handle, ovr.module, ovr.sequence_promote, make_sequence_promote_wrapper)
    for name in _inplace(torch, torch_lists.fp32):
        handle._save_func(torch, name, make_error_if_any_low_precision(getattr(torch, name), name))
    _wrap(handle, torch.Tensor, _inplace(torch.Tensor, tensor_lists.fp32),
          make_error_if_self_low_precision)
    _wrap(handle, torch.Tensor,
          _inplace(torch.Tensor, tensor_lists.low_precision + tensor_lists.promote),
          make_match_self_wrapper)
    rnn.install(handle._save_func)
    for name, message in functional.banned.items():
        _wrap(handle, functional.module, [name], make_banned_wrapper, message)


def _reinstall(handle: AmpHandle, registered: Iterable[Registration]) -> None:
    """Replace the installed patches (if any) by ``handle``'s, carrying ``registered``."""
    previous = _installed
    if isinstance(previous, AmpHandle):
        previous._uninstall()
    try:
        _install(handle, registered)
    except BaseException:
        handle._uninstall()
        raise


def installed_handle() -> AmpHandle | NoOpHandle | None:
    """The handle of the latest ``init`` (None after ``deactivate``)."""
    return _installed


def set_installed_handle(handle: AmpHandle | NoOpHandle | None) -> None:
    """Record ``handle`` as the latest ``init``'s (also what writing ``amp._amp_state.handle`` does)."""
    global _installed
    _installed = handle


def _register(module: object, name: str, dtype: torch.dtype | None) -> None:
    registry.record(module, name, dtype)
    if _installed is not None:
        _installed._apply_registrations()


def register_half_function(module: object, name: str) -> None:
    """Run ``module.name`` in fp16 under amp: at once when O1/O4 patches are installed, else
    from the next ``amp.initialize``."""
    _register(module, name, torch.float16)


def register_bfloat16_function(module: object, name: str) -> None:
    """Run ``module.name`` in bf16 under amp: at once when O1/O4 patches are installed, else
    from the next ``amp.initialize``."""
    _register(module, name, torch.bfloat16)


def register_float_function(module: object, name: str) -> None:
    """Run ``module.name`` in fp32 under amp: at once when O1/O4 patches are installed, else
    from the next ``amp.initialize``."""
    _register(module, name, torch.float32)


def register_promote_function(module: object, name: str) -> None:
    """Run ``module.name`` in the widest floating type of its arguments under amp."""
    _register(module, name, None)


def _describe(run: policy.Policy | None) -> str:
    dtype = policy.casts_to(run)
    return "no O1/O4 casts" if dtype is None else f"O1/O4 casts to {dtype}"


def init(enabled: bool = True, loss_scale: float | str = "dynamic", enable_caching: bool = True,
         verbose: bool = False, allow_banned: bool = False,
         patch_type: torch.dtype = torch.float16) -> AmpHandle | NoOpHandle:
    """Patch torch, torch.Tensor and torch.nn.functional so listed functions run in
    ``patch_type`` (fp16 for O1, bf16 for O4) or fp32, and return the handle.

    The handle's policy applies outside every amp model's forward from now on; models of
    earlier ``initialize`` calls keep their own inside theirs. Patches already installed are
    taken over with the user registrations they carry. ``enabled=False`` removes the patches
    and returns a ``NoOpHandle``. ``allow_banned`` runs banned functions
    (``F.binary_cross_entropy``) in fp32 instead of raising; ``verbose`` prints every inserted
    cast.
    """
    patch_type = _checked_patch_type(patch_type)
    if enabled:
        return _activate(AmpHandle(loss_scale, enable_caching, verbose, allow_banned, patch_type))
    deactivate()
    disabled = NoOpHandle()
    set_installed_handle(disabled)
    policy.set_outside(None)
    return disabled


def _checked_patch_type(patch_type: torch.dtype | None) -> torch.dtype:
    if patch_type is None or patch_type not in (torch.float16, torch.bfloat16):
        raise ValueError(f"patch_type must be torch.float16 (O1) or torch.bfloat16 (O4), "
                         f"got {patch_type}.")
    return patch_type


def _activate(handle: AmpHandle) -> AmpHandle:
    """``init``'s enabled half: install ``handle``'s patches, taking over the installed ones."""
    previous = _installed
    carried = previous._registered if isinstance(previous, AmpHandle) else []
    _reinstall(handle, carried + consume_registry())
    set_installed_handle(handle)
    policy.set_outside(handle)
    return handle


def use_run_policy(options: Options, verbose: bool,
                   earlier_level: str | None) -> AmpHandle | None:
    """Install the casting policy of an ``initialize`` call; return it (None: no casts).

    It becomes the policy outside every amp model's forward. When that changes what code there
    computes for the earlier run (opt level ``earlier_level``, None when there is none), a
    WARNING names both levels: that run's models keep their own policy, but its other code
    (a loss computed outside the model, evaluation code) now follows this one.
    """
    before = policy.outside()
    handle: AmpHandle | None
    if options.patch_torch_functions:
        # What init(loss_scale=..., verbose=..., patch_type=...) does, typed as the AmpHandle it makes.
        patch_type = _checked_patch_type(options.patch_torch_functions_type)
        handle = _activate(AmpHandle(options.loss_scale, verbose=verbose, patch_type=patch_type))
    else:
        handle = None
        policy.set_outside(None)
    if earlier_level is not None and _describe(before) != _describe(handle):
        logger.warning(
            "amp.initialize(opt_level=%r): outside every amp model's forward, torch functions "
            "now run with %s instead of the %s of the earlier opt_level=%r run. That run's models "
            "keep their own casts inside their forward; its code outside them changes.",
            options.opt_level, _describe(handle), _describe(before), earlier_level)
    return handle


def deactivate() -> None:
    """Remove every O1/O4 patch: the patched torch functions are their original objects again.

    A no-op when nothing is patched. Optimizers of earlier ``initialize`` calls keep working,
    and their models compute without the casts.
    """
    handle = _installed
    if handle is not None:
        handle._deactivate()
        set_installed_handle(None)
    policy.set_outside(None)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the block without amp casts, inside amp models' forwards too (exception safe; a
    no-op when no casts apply)."""
    previous = policy.disabled()
    try:
        yield
    finally:
        policy.restore(previous)
