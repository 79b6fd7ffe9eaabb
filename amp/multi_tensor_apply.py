"""Multi-tensor ops with ``amp_C``'s signatures, and the one place that picks their implementation.

Each op below runs the compiled ``amp_C`` kernel when the extension can handle the tensors' device,
and the pure-PyTorch version in ``amp._torch_ops`` otherwise. Both give the same bits (see
``amp._torch_ops`` for the rounding contract), so a missing extension costs speed, never results.

The rule, evaluated per call on the device of the first tensor:

* ``amp_C`` must import, must export the op, and must not be switched off (below);
* CPU tensors: the extension's C++ kernels are used;
* CUDA tensors: only if ``amp_C.cuda_available()`` returns True (an extension built without
  CUDA still serves CPU tensors);
* any other device, or no tensors at all: the PyTorch version.

Switching the extension off: ``AMP_DISABLE_EXTENSION=1`` in the environment sets the process-wide
default; ``with use_extension(False):`` (or ``True``) overrides it for a block, so tests and
benchmarks can compare both paths in one process. The switch is process-global, not per thread.

Amp's own code calls ``multi_tensor_applier(multi_tensor_scale, flag, lists, scale)``; user code
written for Apex may equally pass ``amp_C.multi_tensor_scale`` to the applier.
"""
import contextlib
import os

import torch

from amp import _torch_ops
from amp._amp_state import maybe_print
from amp._compat import local_tensor

try:
    import amp_C
except ImportError as err:
    amp_C = None
    _import_error = err
else:
    _import_error = None

# The ops keep amp_C's names; the list lives with their PyTorch versions.
__all__ = ["MultiTensorApply", "multi_tensor_applier", "use_extension", "path_for",
           *_torch_ops.__all__]

_extension_cuda = amp_C is not None and bool(getattr(amp_C, "cuda_available", lambda: False)())
_extension_enabled = os.environ.get("AMP_DISABLE_EXTENSION", "0") != "1"
_fallback_reported = set()


class MultiTensorApply:
    """Apex's applier: ``applier(op, noop_flag, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag, tensor_lists, *args)``.

    ``available`` says whether ``amp_C`` imported; the ops of this module work either way.
    """

    available = amp_C is not None
    import_err = _import_error

    def __init__(self, chunk_size):
        self.chunk_size = chunk_size

    def check_avail(self):
        if not MultiTensorApply.available:
            raise RuntimeError(
                "The amp_C extension is not built, so its kernels cannot be called directly. "
                "Use the ops of amp.multi_tensor_apply (they fall back to PyTorch), or rebuild with "
                "AMP_CUDA_EXT=1 (or AMP_CPP_EXT=1) pip install --no-build-isolation . "
                f"Original error: {MultiTensorApply.import_err}"
            )

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        # FSDP2's grads are DTensors: the ops work on (and check the overlap of) their local shards.
        tensor_lists = [[local_tensor(t) for t in tensors] for tensors in tensor_lists]
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)


@contextlib.contextmanager
def use_extension(enabled):
    """Within the block, use ``amp_C`` where it applies (``True``) or always PyTorch (``False``)."""
    global _extension_enabled
    previous = _extension_enabled
    _extension_enabled = bool(enabled)
    try:
        yield
    finally:
        _extension_enabled = previous


def _report_fallback_once(reason):
    # Once per process and reason: the fallback is correct, only slower, so it is not worth a
    # warning per step.
    if reason not in _fallback_reported:
        _fallback_reported.add(reason)
        maybe_print(
            f"amp: {reason}; using the PyTorch multi-tensor ops (same results, slower). "
            "Build the kernels with AMP_CUDA_EXT=1 (or AMP_CPP_EXT=1) "
            "pip install --no-build-isolation .",
            rank0=True,
        )


def _fallback_reason(device):
    """Why tensors on ``device`` get the PyTorch versions; None when ``amp_C`` serves them."""
    if not _extension_enabled:
        env = os.environ.get("AMP_DISABLE_EXTENSION", "0") == "1"
        return f"switched off by {'AMP_DISABLE_EXTENSION=1' if env else 'use_extension(False)'}"
    if amp_C is None:
        return f"the amp_C extension is not available ({_import_error})"
    if device.type == "cuda" and not _extension_cuda:
        return "amp_C was built without CUDA kernels"
    if device.type not in ("cpu", "cuda"):
        return f"amp_C has no kernels for {device.type} tensors"
    return None


def _extension_serves(device):
    reason = _fallback_reason(device)
    # Worth a note when building amp_C would help; a switch-off or another device is by choice.
    if reason is not None and _extension_enabled and device.type in ("cpu", "cuda"):
        _report_fallback_once(reason)
    return reason is None


def path_for(op_name, device):
    """``("amp_C", why)`` or ``("torch", why)``: which implementation the op ``op_name`` of this
    module runs for tensors on ``device``, by the rule above (for reports: ``python -m amp.check``).
    """
    getattr(_torch_ops, op_name)  # an unknown op name is an AttributeError here too
    device = torch.device(device)
    reason = _fallback_reason(device)
    if reason is None and getattr(amp_C, op_name, None) is None:
        reason = f"this amp_C build has no {op_name} (rebuild it)"
    if reason is not None:
        return "torch", reason
    return "amp_C", f"amp_C serves {device.type} tensors"


def _implementation(name, device):
    if device is not None and _extension_serves(device):
        kernel = getattr(amp_C, name, None)
        if kernel is not None:
            return kernel
    return getattr(_torch_ops, name)


def _device_of(tensor_lists):
    for tensors in tensor_lists:
        if len(tensors) > 0:
            return tensors[0].device
    return None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``[in, out]``: ``out = float(in) * scale``; sets ``noop_flag`` on a non-finite input."""
    op = _implementation("multi_tensor_scale", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, scale)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``[x, y, out]``: ``out = a*x + b*y``; checks x (0), y (1), both (-1) or neither."""
    op = _implementation("multi_tensor_axpby", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """``[x]`` -> ``(total norm [1], per-tensor norms [n] or [0])``, accumulated in fp32."""
    op = _implementation("multi_tensor_l2norm", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """As ``multi_tensor_l2norm``, but zero results when ``noop_flag`` is already set."""
    op = _implementation("multi_tensor_l2norm_mp", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """Norms of ``x * inv_scale``, leaving x unchanged."""
    op = _implementation("multi_tensor_unscale_l2norm", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor)


def update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                            growth_factor, backoff_factor, growth_interval, hysteresis,
                            min_scale=None, max_scale=None, inv_scale=None, should_skip=None):
    """Device-side loss-scale update with hysteresis (see ``amp._torch_ops``); returns the scale.

    The optional clamp and outputs make it amp's whole scale update in one call.
    """
    op = _implementation("update_scale_hysteresis", current_scale.device)
    return op(current_scale, growth_tracker, hysteresis_tracker, found_inf,
              growth_factor, backoff_factor, growth_interval, hysteresis,
              min_scale, max_scale, inv_scale, should_skip)


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
                     first_run, wd_after_momentum, scale):
    """Fused SGD step on ``[grads, weights, momentum_bufs(, model_copies)]``; a no-op when
    ``noop_flag`` is set (see ``amp._torch_ops.multi_tensor_sgd`` for the arithmetic)."""
    op = _implementation("multi_tensor_sgd", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
              first_run, wd_after_momentum, scale)


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                      bias_correction, weight_decay, inv_scale=1.0):
    """Fused Adam/AdamW step on ``[grads, params, exp_avgs, exp_avg_sqs(, model_copies)]``; a no-op
    when ``noop_flag`` is set (see ``amp._torch_ops.multi_tensor_adam`` for the arithmetic)."""
    op = _implementation("multi_tensor_adam", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
              bias_correction, weight_decay, inv_scale)
