"""Multi-tensor ops with ``amp_C``'s signatures, and the one place that picks their implementation.

Each op below runs the compiled ``amp_C`` kernel when the extension can handle the tensors' device,
and the pure-PyTorch version in ``amp._pytorch_ops`` otherwise. Both give the same bits (see
``amp._pytorch_ops`` for the rounding contract), so a missing extension costs speed, never results.

The rule, evaluated per call on the device of the first tensor:

* ``amp_C`` must import, must export the op, and must not be switched off (below);
* CPU tensors: the extension's C++ kernels are used;
* CUDA tensors: only if ``amp_C.cuda_available()`` returns True (an extension built without
  CUDA still serves CPU tensors) and the GPU code it was built for runs on the tensors' GPU
  (``covers``);
* any other device, or no tensors at all: the PyTorch version.

Switching the extension off: ``AMP_DISABLE_EXTENSION=1`` in the environment sets the process-wide
default; ``with use_extension(False):`` (or ``True``) overrides it for a block, so tests and
benchmarks can compare both paths in one process. The switch is process-global, not per thread.

A GPU the build holds no code for (a V100 or T4 with the default sm_80-and-up build, a GPU newer
than a build without PTX) takes the PyTorch path, with one WARNING on the ``amp`` logger that gives
the ``TORCH_CUDA_ARCH_LIST`` to rebuild with.

Check before trusting: the first time ``amp_C`` would serve a device in a process (the CPU, each
GPU), amp runs its first-use self-test there (``amp.check.first_use``: every op on a few cases
against the PyTorch version, about 0.2 s on a CPU) and uses the kernels on that device only if all
agree. On a difference or an error it logs one ERROR naming the op, the device, the first
difference and ``python -m amp.check``, and that device takes the PyTorch path for the rest of the
process: training goes on with the same results, only slower. ``amp.initialize`` runs it for its
models' devices, so that it happens eagerly, before any step is compiled or captured; otherwise the
first op on the device runs it. It never runs while ``torch.compile`` traces, during CUDA graph
capture or under a ``TorchDispatchMode`` (fake tensors): there a device not yet tested takes the
PyTorch path, and the test waits for the next eager call. A second thread that reaches an untested
device waits for the first thread's test. ``AMP_DISABLE_SELF_TEST=1`` in the environment turns it
off (``amp_C`` is then trusted as built); ``with use_self_test(False):`` does so for a block
(``python -m amp.check``, which tests every kernel itself).

Amp's own code calls ``multi_tensor_applier(multi_tensor_scale, flag, lists, scale)``; user code
written for Apex may equally pass ``amp_C.multi_tensor_scale`` to the applier.

Memory formats: both implementations pair the tensors of one index in memory order and refuse
tensors stored in different orders (a channels_last param with a contiguous grad). amp can hand
them such tensors itself (a ``.grad`` the user assigned, a model made channels_last after
``initialize``), so scale, axpby, sgd, adam and lamb here run a call refused for that again on copies in
one memory format (``amp._memory_formats``); ``amp_C``'s ops called directly refuse it.

Types: ``tensor_lists`` is a sequence of equally long sequences of tensors (``TensorLists``); a
coefficient that may stay on the device is a host number or a 1-element fp32 tensor (``Scalar``).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar, Union

import torch

from amp import _memory_formats, _pytorch_ops
from amp._logging import logger, maybe_print
from amp._compat import is_compiling, local_tensor

_import_error: ImportError | None
try:
    import amp_C
except ImportError as err:
    amp_C = None
    _import_error = err
else:
    _import_error = None
    if getattr(amp_C, "AMP_APEX_STAND_IN", False):
        # With the drop-in switch on, `import amp_C` is its stand-in (Apex's op names on this
        # module's ops): the extension, if built, is behind it.
        amp_C, _import_error = amp_C.built, amp_C.built_error
    # NVIDIA Apex ships a module of the same name whose ops lack amp's arguments (e.g. Adam's
    # inv_scale, the scale update's clamp): amp's own build answers build_info(), Apex's does not.
    if amp_C is not None and not hasattr(amp_C, "build_info"):
        _import_error = ImportError(
            f"the amp_C found at {getattr(amp_C, '__file__', '?')} is not amp's (NVIDIA Apex's, or one "
            "built from an older amp): amp does not call it")
        amp_C = None

# The ops keep amp_C's names; the list lives with their PyTorch versions.
__all__ = ["MultiTensorApply", "multi_tensor_applier", "use_extension", "use_self_test", "decide_paths",
           "path_for", "covers", "TensorLists", "Scalar", *_pytorch_ops.__all__]

#: ``[list0, list1, ...]``: an op's tensor lists; the tensors at one index are processed together.
TensorLists = Sequence[Sequence[torch.Tensor]]
#: A coefficient: a host number, or a 1-element float32 tensor on the tensors' device.
Scalar = Union[float, torch.Tensor]
_R = TypeVar("_R")

_extension_cuda = amp_C is not None and bool(getattr(amp_C, "cuda_available", lambda: False)())
_extension_enabled = os.environ.get("AMP_DISABLE_EXTENSION", "0") != "1"
_fallback_reported: set[str] = set()
# How to build amp_C, for an installed amp-torch (pip rebuilds it from its sdist; --no-cache-dir, or
# pip reuses the wheel it built before, whatever AMP_*_EXT says now) and in a checkout.
_PIP_REBUILD = ("pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir "
                "--no-binary amp-torch amp-torch")
_CHECKOUT_BUILD = "pip install --no-build-isolation ."
_BUILD_HINT = (f"AMP_CUDA_EXT=1 (or AMP_CPP_EXT=1 for the CPU kernels alone) {_PIP_REBUILD} "
               f"(in a checkout: AMP_CUDA_EXT=1 {_CHECKOUT_BUILD})")

_self_test_enabled = os.environ.get("AMP_DISABLE_SELF_TEST", "0") != "1"
# The first-use self-test's verdicts, by device ("cpu", "cuda:0"): passed, or why amp_C failed.
_self_test_passed: set[str] = set()
_self_test_failures: dict[str, str] = {}
_self_test_lock = threading.Lock()
_self_testing = threading.local()  # .active: this thread is running the self-test (its own calls)


class MultiTensorApply:
    """Apex's applier: ``applier(op, noop_flag, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag, tensor_lists, *args)``.

    ``available`` says whether ``amp_C`` imported; the ops of this module work either way.
    """

    available = amp_C is not None
    import_err = _import_error

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        if not MultiTensorApply.available:
            raise RuntimeError(
                "The amp_C extension is not built, so its kernels cannot be called directly. "
                "Use the ops of amp.multi_tensor_apply (they fall back to PyTorch), or build it with "
                f"{_BUILD_HINT}. Original error: {MultiTensorApply.import_err}"
            )

    def __call__(self, op: Callable[..., _R], noop_flag_buffer: torch.Tensor, tensor_lists: TensorLists,
                 *args: Any) -> _R:
        # FSDP2's grads are DTensors: the ops work on (and check the overlap of) their local shards.
        tensor_lists = [[local_tensor(t) for t in tensors] for tensors in tensor_lists]
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(_pytorch_ops.contract.AMP_CHUNK_SIZE)


@contextlib.contextmanager
def use_extension(enabled: bool) -> Iterator[None]:
    """Within the block, use ``amp_C`` where it applies (``True``) or always PyTorch (``False``)."""
    global _extension_enabled
    previous = _extension_enabled
    _extension_enabled = bool(enabled)
    try:
        yield
    finally:
        _extension_enabled = previous


@contextlib.contextmanager
def use_self_test(enabled: bool) -> Iterator[None]:
    """Within the block, run and heed ``amp_C``'s first-use self-test (``True``) or neither
    (``False``: ``amp_C`` serves wherever the rule above allows, as built)."""
    global _self_test_enabled
    previous = _self_test_enabled
    _self_test_enabled = bool(enabled)
    try:
        yield
    finally:
        _self_test_enabled = previous


def _report_fallback_once(reason: str, warn: bool = False) -> None:
    # Once per process and reason: the fallback is correct, only slower, so it is not worth a
    # message per step. A build without code for this GPU is worth a WARNING (every process: GPUs
    # may differ between ranks); a missing or switched-off amp_C only a note.
    if reason in _fallback_reported:
        return
    _fallback_reported.add(reason)
    if warn:
        logger.warning("amp: %s. Until then amp runs the PyTorch multi-tensor ops there (same results, "
                       "slower).", reason)
    else:
        maybe_print(
            f"amp: {reason}; using the PyTorch multi-tensor ops (same results, slower). "
            f"Build the kernels with {_BUILD_HINT}",
            rank0=True,
        )


def _image_covers(image: str, major: int, minor: int) -> bool:
    match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", image)
    if match is None:
        return False
    kind, suffix = match.group(1), match.group(4)
    img_major, img_minor = int(match.group(2)), int(match.group(3))
    if suffix == "a":  # architecture-specific code runs on exactly that GPU
        return (major, minor) == (img_major, img_minor)
    if kind == "sm" or suffix == "f":  # SASS runs on later minors of the same major
        return major == img_major and minor >= img_minor
    return (major, minor) >= (img_major, img_minor)  # PTX is JIT-compiled for any later GPU


def covers(images: Sequence[str] | None, capability: Sequence[int]) -> bool | None:
    """Whether code compiled to ``images`` (``sm_90``, ``compute_80``...) runs on a GPU of
    ``capability`` (major, minor); None when the images are unknown."""
    if images is None:
        return None
    return any(_image_covers(image, capability[0], capability[1]) for image in images)


_missing_gpu_code: dict[int, str | None] = {}


def _gpu_code_missing(device: torch.device) -> str | None:
    """Why ``amp_C`` cannot run on this GPU (it holds no code for its architecture), or None.

    Decided once per device: without it the first kernel launch would fail with CUDA's "no kernel
    image is available" in the middle of training.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _missing_gpu_code:
        build_info = getattr(amp_C, "build_info", None)
        images = build_info().get("cuda_images") if build_info is not None else None
        major, minor = torch.cuda.get_device_capability(index)
        reason = None
        if covers(images, (major, minor)) is False:
            archs = rebuild_arch_list(images or [], (major, minor))
            reason = (f"amp_C holds no GPU code for cuda:{index} ({torch.cuda.get_device_name(index)}, "
                      f"sm_{major}{minor}; it was built for {', '.join(images or ()) or 'no GPU'}): rebuild "
                      f'it with TORCH_CUDA_ARCH_LIST="{archs}" AMP_CUDA_EXT=1 {_PIP_REBUILD} (in a '
                      f'checkout: TORCH_CUDA_ARCH_LIST="{archs}" AMP_CUDA_EXT=1 {_CHECKOUT_BUILD})')
        _missing_gpu_code[index] = reason
    return _missing_gpu_code[index]


def rebuild_arch_list(images: Sequence[str], capability: Sequence[int]) -> str:
    """The ``TORCH_CUDA_ARCH_LIST`` that keeps the architectures of ``images`` and adds a GPU of
    ``capability``, with PTX of the highest, so that later GPUs JIT-compile it."""
    archs = {(int(capability[0]), int(capability[1]), "")}
    for image in images:
        match = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)([af]?)", image)
        if match is not None:
            archs.add((int(match.group(1)), int(match.group(2)), match.group(3)))
    names = [f"{major}.{minor}{suffix}" for major, minor, suffix in sorted(archs)]
    return ";".join(names) + "+PTX"


def _fallback_reason(device: torch.device) -> str | None:
    """Why tensors on ``device`` get the PyTorch versions; None when ``amp_C`` serves them."""
    if not _extension_enabled:
        env = os.environ.get("AMP_DISABLE_EXTENSION", "0") == "1"
        return f"switched off by {'AMP_DISABLE_EXTENSION=1' if env else 'use_extension(False)'}"
    if amp_C is None:
        return f"the amp_C extension is not available ({_import_error})"
    if device.type == "cuda":
        return "amp_C was built without CUDA kernels" if not _extension_cuda else _gpu_code_missing(device)
    if device.type != "cpu":
        return f"amp_C has no kernels for {device.type} tensors"
    return None


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def _distrusted(device: torch.device, run: bool) -> str | None:
    """Why amp_C is not to be used on ``device`` although it could be: its first-use self-test failed
    there, or (``run``) has not run and cannot run now. None: trusted. With ``run``, runs the test
    once per device and process where none ran yet."""
    if not _self_test_enabled:
        return None
    key = _device_key(device)
    if key in _self_test_passed:
        return None
    if key in _self_test_failures:
        return _self_test_failures[key]
    if not run:
        return None
    # Checked first, and without touching the lock or the thread-local: dynamo traces this code.
    if is_compiling():
        return f"amp_C's first-use self-test has not run on {key} yet, and never runs inside torch.compile"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return f"amp_C's first-use self-test has not run on {key} yet, and never runs during CUDA graph capture"
    if torch._C._len_torch_dispatch_stack() > 0:
        return f"amp_C's first-use self-test has not run on {key} yet, and never runs under a TorchDispatchMode"
    if getattr(_self_testing, "active", False):
        return "amp_C's first-use self-test is running in this thread"  # an op it runs came back here
    return _run_self_test(key, device)


def _run_self_test(key: str, device: torch.device) -> str | None:
    with _self_test_lock:  # another thread may have tested the device while this one waited
        if key in _self_test_passed:
            return None
        if key in _self_test_failures:
            return _self_test_failures[key]
        _self_testing.active = True
        try:
            passed, detail = _first_use_self_test(device)
        finally:
            _self_testing.active = False
        if passed:
            _self_test_passed.add(key)
            return None
        _self_test_failures[key] = f"amp_C failed amp's first-use self-test on {key} ({detail})"
    # Every process says it: a broken GPU on one rank is news there.
    logger.error("amp: amp_C failed amp's first-use self-test on %s: %s. amp runs the PyTorch "
                 "multi-tensor ops on %s for the rest of this process (same results, slower). Run "
                 "`python -m amp.check` for the full report, and include its output when you report "
                 "this.", key, detail, key)
    return _self_test_failures[key]


def _first_use_self_test(device: torch.device) -> tuple[bool, str]:
    """(passed, what failed): ``amp.check.first_use`` on ``device``. Never raises: the user's step
    is what called it."""
    try:
        from amp.check import first_use, report  # imported here: amp.check imports amp

        result = first_use.self_test(amp_C, device)
    except Exception as err:  # noqa: BLE001 - a test that cannot run proves nothing
        return False, f"the self-test could not run: {type(err).__name__}: {err}"
    return result.status == report.PASS, result.detail


def _extension_serves(device: torch.device) -> bool:
    reason = _fallback_reason(device)
    if reason is None:
        return _distrusted(device, run=True) is None
    # Worth a note when building amp_C would help; a switch-off or another device is by choice.
    if _extension_enabled and device.type in ("cpu", "cuda"):
        _report_fallback_once(reason, warn=reason in _missing_gpu_code.values())
    return False


def decide_paths(devices: Iterable[torch.device]) -> None:
    """Decide now which path serves each of ``devices``: report a fallback, run the first-use
    self-test. ``amp.initialize`` calls it for its models' devices, so that this happens eagerly,
    before a step can be compiled or captured."""
    for device in dict.fromkeys(devices):
        _extension_serves(device)


def path_for(op_name: str, device: torch.device | str) -> tuple[str, str]:
    """``("amp_C", why)`` or ``("torch", why)``: which implementation the op ``op_name`` of this
    module runs for tensors on ``device``, by the rule above (for reports: ``python -m amp.check``).
    """
    getattr(_pytorch_ops, op_name)  # an unknown op name is an AttributeError here too
    device = torch.device(device)
    reason = _fallback_reason(device) or _distrusted(device, run=False)
    if reason is None and getattr(amp_C, op_name, None) is None:
        reason = f"this amp_C build has no {op_name} (rebuild it)"
    if reason is not None:
        return "torch", reason
    return "amp_C", f"amp_C serves {device.type} tensors"


def _implementation(name: str, device: torch.device | None) -> Callable[..., Any]:
    if device is not None and _extension_serves(device):
        kernel = getattr(amp_C, name, None)
        if kernel is not None:
            return kernel
    return getattr(_pytorch_ops, name)


def _device_of(tensor_lists: TensorLists) -> torch.device | None:
    for tensors in tensor_lists:
        if len(tensors) > 0:
            return tensors[0].device
    return None


def _run(name: str, chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
         *args: Any) -> Any:
    """Run the op ``name`` where the rule above says; a call refused because tensors of one index
    are stored in different memory formats runs again on copies (``amp._memory_formats``)."""
    op = _implementation(name, _device_of(tensor_lists))
    try:
        return op(chunk_size, noop_flag, tensor_lists, *args)
    except ValueError:
        staged = _memory_formats.restaged(name, tensor_lists)
        if staged is None:
            raise
    lists, written = staged
    # As DDP warns when grads and params differ in strides: once per op (Python's default filter).
    warnings.warn(f"amp: {name} got tensors of one index in different memory formats (a .grad "
                  "assigned in another format than its parameter's, or a model made channels_last "
                  "after amp.initialize?), so amp copies them on every call; give them one memory "
                  "format to save the copies.", stacklevel=2)
    result = op(chunk_size, noop_flag, lists, *args)
    _memory_formats.write_back(written)
    return result


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                       scale: Scalar) -> None:
    """``[in, out]``: ``out = float(in) * scale``; sets ``noop_flag`` on a non-finite input."""
    return _run("multi_tensor_scale", chunk_size, noop_flag, tensor_lists, scale)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, a: Scalar,
                       b: Scalar, arg_to_check: int) -> None:
    """``[x, y, out]``: ``out = a*x + b*y``; checks x (0), y (1), both (-1) or neither."""
    return _run("multi_tensor_axpby", chunk_size, noop_flag, tensor_lists, a, b, arg_to_check)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                        per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[x]`` -> ``(total norm [1], per-tensor norms [n] or [0])``, accumulated in fp32."""
    op = _implementation("multi_tensor_l2norm", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                           per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``multi_tensor_l2norm``, but zero results when ``noop_flag`` is already set."""
    op = _implementation("multi_tensor_l2norm_mp", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                                inv_scale: Scalar,
                                per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of ``x * inv_scale``, leaving x unchanged."""
    op = _implementation("multi_tensor_unscale_l2norm", _device_of(tensor_lists))
    return op(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor)


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor,
                            growth_factor: float, backoff_factor: float, growth_interval: int,
                            hysteresis: int, min_scale: float | None = None,
                            max_scale: float | None = None, inv_scale: torch.Tensor | None = None,
                            should_skip: torch.Tensor | None = None) -> torch.Tensor:
    """Device-side loss-scale update with hysteresis (see ``amp._pytorch_ops``); returns the scale.

    The optional clamp and outputs make it amp's whole scale update in one call.
    """
    op = _implementation("update_scale_hysteresis", current_scale.device)
    return op(current_scale, growth_tracker, hysteresis_tracker, found_inf,
              growth_factor, backoff_factor, growth_interval, hysteresis,
              min_scale, max_scale, inv_scale, should_skip)


def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, wd: float,
                     momentum: float, dampening: float, lr: float, nesterov: bool, first_run: bool,
                     wd_after_momentum: bool, scale: Scalar) -> None:
    """Fused SGD step on ``[grads, weights, momentum_bufs(, model_copies)]``; a no-op when
    ``noop_flag`` is set (see ``amp._pytorch_ops.multi_tensor_sgd`` for the arithmetic)."""
    return _run("multi_tensor_sgd", chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr,
                nesterov, first_run, wd_after_momentum, scale)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int | torch.Tensor, mode: int,
                      bias_correction: int, weight_decay: float, inv_scale: Scalar = 1.0) -> None:
    """Fused Adam/AdamW step on ``[grads, params, exp_avgs, exp_avg_sqs(, model_copies)]``; a no-op
    when ``noop_flag`` is set (see ``amp._pytorch_ops.multi_tensor_adam`` for the arithmetic)."""
    return _run("multi_tensor_adam", chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon,
                step, mode, bias_correction, weight_decay, inv_scale)


def multi_tensor_lamb(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int, bias_correction: int,
                      weight_decay: float, grad_averaging: int, mode: int, global_grad_norm: Scalar,
                      max_grad_norm: float, use_nvlamb: bool | None = None, inv_scale: Scalar = 1.0) -> None:
    """Fused LAMB step on ``[grads, params, exp_avgs, exp_avg_sqs(, model_copies)]``; a no-op when
    ``noop_flag`` is set (see ``amp._pytorch_ops.multi_tensor_lamb`` for the arithmetic)."""
    return _run("multi_tensor_lamb", chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon,
                step, bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                max_grad_norm, use_nvlamb, inv_scale)
