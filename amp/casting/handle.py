"""The O1/O4 handle: installs the function patches, owns the weight-cast cache, removes both.

``init`` is Apex's ``amp.init``; ``amp.initialize`` calls it for O1 (``patch_type=torch.float16``)
and O4 (``torch.bfloat16``). Differences from Apex, on purpose: a new ``init`` removes the
previous handle's patches first (no stacked wrappers); ``_deactivate`` restores every patched
attribute, the RNN ``_VF`` shim included, in reverse order, and turns the handle (and so the
decorators) off, and ``deactivate`` (``amp.deactivate()``) is its public form; ``disable_casts``
is exception safe and a no-op without a handle.
"""
import contextlib

import torch

from .._amp_state import _amp_state
from . import lists, rnn
from .registry import consume_registry
from .wrap import (make_cast_wrapper, make_error_if_any_low_precision,
                   make_error_if_self_low_precision, make_match_self_wrapper,
                   make_promote_wrapper, make_sequence_promote_wrapper)

__all__ = ["AmpHandle", "NoOpHandle", "init", "deactivate", "disable_casts"]

_OLD_API_ERROR = (
    "The old Amp API (amp.init() + handle.scale_loss / handle.wrap_optimizer) is no longer "
    "supported. Use `model, optimizer = amp.initialize(model, optimizer, opt_level=\"O1\")` and "
    "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`.")
_MISSING = object()


class AmpHandle:
    """The state of one O1/O4 installation: the patches it made and its weight-cast cache.

    ``cache`` maps each fp32 Parameter cast to low precision in the current iteration to
    ``(cast copy, parameter version at cast time)``; ``_clear_cache()`` empties it (amp does so
    at every ``scale_loss`` exit).
    """

    def __init__(self, loss_scale="dynamic", enable_caching=True, verbose=False):
        self.loss_scale = loss_scale
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._cache = {}
        self._is_active = True
        self._all_wrappers = []

    def is_active(self):
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self):
        previous = self._is_active
        self._is_active = False
        try:
            yield
        finally:
            self._is_active = previous

    def wrap_optimizer(self, optimizer, num_loss=1):
        raise RuntimeError(_OLD_API_ERROR)

    def scale_loss(self, loss, optimizer):
        raise RuntimeError(_OLD_API_ERROR)

    def _clear_cache(self):
        self._cache.clear()

    def remove_cache(self, param):
        self._cache.pop(param, None)

    def _save_func(self, owner, name, new):
        """Install ``new`` as ``owner.name``, remembering the exact previous entry."""
        self._all_wrappers.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, new)

    def _deactivate(self):
        """Restore every patched attribute to the object it was before ``init``."""
        # Reverse order, so a name patched twice ends up on the original, not the first wrapper.
        for owner, name, previous in reversed(self._all_wrappers):
            if previous is _MISSING:
                delattr(owner, name)  # it was inherited (e.g. Tensor.add from TensorBase)
            else:
                setattr(owner, name, previous)
        self._all_wrappers = []
        self._is_active = False
        self._cache.clear()

    @property
    def has_cache(self):
        return self._enable_caching

    @property
    def cache(self):
        return self._cache

    @property
    def verbose(self):
        return self._verbose


class NoOpHandle:
    """The handle of ``init(enabled=False)``: nothing is patched or cast."""

    def is_active(self):
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    def wrap_optimizer(self, optimizer, num_loss=1):
        raise RuntimeError(_OLD_API_ERROR)

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        yield loss

    @property
    def has_cache(self):
        return False

    @property
    def verbose(self):
        return False

    def _clear_cache(self):
        pass

    def _deactivate(self):
        pass


def _wrap(handle, module, names, make, *extra):
    for name in names:
        handle._save_func(module, name, make(getattr(module, name), name, handle, *extra))


def _inplace(module, names):
    return [n + "_" for n in names if hasattr(module, n + "_")]


def _install(handle, patch_type, allow_banned):
    # User registrations first, so they end up innermost and override the lists below.
    for module, name, dtype in consume_registry():
        if dtype is None:
            _wrap(handle, module, [name], make_promote_wrapper)
        else:
            _wrap(handle, module, [name], make_cast_wrapper, dtype, dtype is not torch.float32)
    functional, torch_lists, tensor_lists = lists.overrides(patch_type)
    for ovr in (functional, torch_lists, tensor_lists):
        _wrap(handle, ovr.module, ovr.low_precision, make_cast_wrapper, patch_type, True)
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
    rnn.install(handle, patch_type)
    for name, message in functional.banned.items():
        orig = getattr(functional.module, name)
        if allow_banned:
            new = make_cast_wrapper(orig, name, handle, torch.float32, False)
        else:
            new = make_error_if_any_low_precision(orig, name, message)
        handle._save_func(functional.module, name, new)


def init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False,
         allow_banned=False, patch_type=torch.float16):
    """Patch torch, torch.Tensor and torch.nn.functional so listed functions run in
    ``patch_type`` (fp16 for O1, bf16 for O4) or fp32, and return the handle.

    The previous handle's patches are removed first. ``enabled=False`` returns a ``NoOpHandle``.
    ``allow_banned`` runs banned functions (``F.binary_cross_entropy``) in fp32 instead of raising;
    ``verbose`` prints every inserted cast.
    """
    if patch_type not in (torch.float16, torch.bfloat16):
        raise ValueError(f"patch_type must be torch.float16 (O1) or torch.bfloat16 (O4), "
                         f"got {patch_type}.")
    deactivate()
    if not enabled:
        handle = NoOpHandle()
    else:
        handle = AmpHandle(loss_scale, enable_caching, verbose)
        try:
            _install(handle, patch_type, allow_banned)
        except BaseException:
            handle._deactivate()
            raise
    _amp_state.handle = handle
    return handle


def deactivate():
    """Remove every O1/O4 patch: the patched torch functions are their original objects again.

    A no-op when nothing is patched. Optimizers of earlier ``initialize`` calls keep working,
    without the casts.
    """
    handle = _amp_state.handle
    if handle is not None:
        handle._deactivate()
        _amp_state.handle = None


@contextlib.contextmanager
def disable_casts():
    """Run the block without amp casts (exception safe; a no-op when amp is not initialised)."""
    handle = _amp_state.handle
    if handle is None:
        yield
    else:
        with handle._disable_casts():
            yield
