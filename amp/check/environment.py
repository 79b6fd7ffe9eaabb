"""What this machine is and which path amp's multi-tensor ops take on it.

The first half of a bug report: versions, whether ``amp_C`` is built and what it holds (the GPU
code it was compiled to, the CPU code paths it takes here), whether that code covers each visible
GPU, and, per device and op, ``amp_C`` or the PyTorch fallback and why. The choice itself is
``amp.multi_tensor_apply.path_for``'s; this module only reports it.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import amp
from amp import _pytorch_ops
from amp import multi_tensor_apply as mta

__all__ = ["OPS", "collect", "describe", "visible_devices"]

# Every op amp_C exports, in the order docs/reference.md lists them.
OPS: List[str] = list(_pytorch_ops.__all__)

# The CPU flags that decide which code amp_C's CPU kernels (and torch's) run.
_CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_fp16", "asimd", "fphp", "sve")


def visible_devices() -> List[torch.device]:
    """The CPU and every CUDA device PyTorch sees."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def _nvcc_version() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if nvcc is None or not os.path.exists(nvcc):
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"unknown ({nvcc}: {err})"
    match = re.search(r"release (\d+\.\d+)", out)
    return f"{match.group(1)} ({nvcc})" if match else f"unknown ({nvcc})"


def _cuda_driver() -> Optional[str]:
    """The newest CUDA the installed driver supports ("13.0"), or None without one (Linux only).

    Asked of the driver library itself: it needs no GPU and starts no CUDA context."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if driver.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _version_tuple(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _versions() -> Dict[str, Any]:
    return {
        "amp": amp.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_driver": _cuda_driver(),
        "nvcc": _nvcc_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _extension() -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """What ``amp_C`` is, as ``amp.multi_tensor_apply`` imported it, and its ``build_info()``."""
    ext = mta.amp_C
    info = ext.build_info() if ext is not None and hasattr(ext, "build_info") else {}
    error = mta.multi_tensor_applier.import_err
    return {
        "built": ext is not None,
        "file": getattr(ext, "__file__", None),
        "error": None if ext is not None or error is None else str(error),
        "cuda_kernels": info.get("cuda_kernels"),
        "cuda_runtime": info.get("cuda_runtime"),
        "cuda_available": bool(ext.cuda_available()) if ext is not None else None,
        # None: unknown (an amp_C built before it recorded them); [] without CUDA kernels.
        "cuda_images": info.get("cuda_images"),
    }, info


def _cpu_path(built: bool, info: Dict[str, Any]) -> str:
    """Which code amp_C's CPU kernels run here, in words."""
    if not built:
        return "none (amp_C is not built)"
    if "cpu_runs_x86_64_v3" not in info:
        return "unknown (this amp_C predates build_info(); rebuild it)"
    if info["cpu_runs_x86_64_v3"]:
        loops = "x86-64-v3 clones (AVX2, FMA, F16C)"
    elif info["cpu_x86_64_v3_clones"]:
        loops = "baseline x86-64 clones (this CPU lacks x86-64-v3)"
    else:
        loops = "the compiler's default target (built without x86-64-v3 clones)"
    stores = "F16C, 8 per instruction" if info["cpu_f16c_stores"] else "scalar conversion"
    return f"loops: {loops}; fp16 stores: {stores}"


def _cpu(built: bool, info: Dict[str, Any]) -> Dict[str, Any]:
    name, flags = platform.processor() or platform.machine(), None
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        pass
    else:
        model = re.search(r"^(?:model name|Hardware|cpu model)\s*:\s*(.+)$", cpuinfo, re.M)
        name = model.group(1).strip() if model else name
        features = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.M)
        present = set(features.group(1).split()) if features else set()
        flags = [flag for flag in _CPU_FLAGS if flag in present]
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "name": name,
        "flags": flags,
        "torch_capability": capability,
        "amp_C_x86_64_v3": info.get("cpu_runs_x86_64_v3"),
        "amp_C_f16c_stores": info.get("cpu_f16c_stores"),
        "amp_C_path": _cpu_path(built, info),
    }


def _device(device: torch.device, ext: Dict[str, Any], cpu_name: str) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"device": str(device), "name": cpu_name, "capability": None,
                             "amp_C_covers": None, "ops": []}
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        entry["name"] = torch.cuda.get_device_name(device)
        entry["capability"] = f"{capability[0]}.{capability[1]}"
        if ext["built"] and ext["cuda_kernels"]:
            entry["amp_C_covers"] = mta.covers(ext["cuda_images"], capability)
        elif ext["built"] and ext["cuda_kernels"] is not None:
            entry["amp_C_covers"] = False
    for op in OPS:
        # A GPU that amp_C holds no code for takes the PyTorch path, with the rebuild command as why.
        path, reason = mta.path_for(op, device)
        entry["ops"].append({"op": op, "path": path, "reason": reason})
    return entry


def collect(devices: Sequence[torch.device]) -> Dict[str, Any]:
    """The environment part of the report (the JSON's ``versions``, ``amp_C``, ``cpu``, ``devices``)."""
    ext, info = _extension()
    cpu = _cpu(ext["built"], info)
    env = {"versions": _versions(), "amp_C": ext, "cpu": cpu,
           "devices": [_device(device, ext, cpu["name"]) for device in devices]}
    return env


def _cuda_lines(torch_cuda: Optional[str], driver: Optional[str], amp_runtime: Optional[str]) -> List[str]:
    """The CUDA versions side by side: amp_C links its own runtime statically (see setup.py), so
    one process holds two runtimes, torch's and amp_C's, on one driver."""
    if torch_cuda is None and driver is None and amp_runtime is None:
        return []
    lines = [f"  CUDA: driver supports {driver or 'none found'}; torch's runtime {torch_cuda or 'none'}; "
             f"amp_C's runtime {amp_runtime + ' (linked in statically)' if amp_runtime else 'none'}"]
    newer, supported = _version_tuple(amp_runtime), _version_tuple(driver)
    if newer is not None and supported is not None and newer > supported:
        same_major = newer[0] == supported[0]
        lines.append(f"    amp_C's runtime {amp_runtime} is newer than this driver's {driver}: "
                     + ("it runs by CUDA's minor version compatibility, but this driver cannot JIT-compile "
                        "its PTX, so a GPU amp_C holds no SASS for fails amp's first-use self-test there"
                        if same_major else "its kernels cannot run here")
                     + f"; update the driver, or build amp_C with a CUDA {driver} toolkit")
    return lines


def describe(env: Dict[str, Any]) -> List[str]:
    """The environment as the lines printed at the top of the report."""
    v, ext, cpu = env["versions"], env["amp_C"], env["cpu"]
    torch_cuda = v["torch_cuda"] or "none (CPU-only build)"
    lines = [f"  amp {v['amp']}, torch {v['torch']} (CUDA runtime {torch_cuda}), "
             f"nvcc {v['nvcc'] or 'not found'}, Python {v['python']}",
             f"  platform: {v['platform']}"]
    if ext["built"]:
        kernels = {True: "yes", False: "no", None: "unknown"}[ext["cuda_kernels"]]
        images = ", ".join(ext["cuda_images"]) if ext["cuda_images"] else (
            "unknown" if ext["cuda_images"] is None else "none")
        lines.append(f"  amp_C: built ({ext['file']}); CUDA kernels: {kernels} (images: {images}); "
                     f"cuda_available(): {ext['cuda_available']}")
    else:
        lines.append(f"  amp_C: not built ({ext['error']}): amp runs the PyTorch ops everywhere (the same "
                     "results, slower), and the checks of amp_C's kernels are skipped")
        lines.append(f"    build it with {mta._BUILD_HINT}")
    lines += _cuda_lines(v["torch_cuda"], v["cuda_driver"], ext.get("cuda_runtime"))
    flags = "unknown" if cpu["flags"] is None else (" ".join(cpu["flags"]) or "none of interest")
    lines.append(f"  CPU: {cpu['name']}; flags: {flags}; torch's CPU capability: {cpu['torch_capability']}")
    lines.append(f"  amp_C CPU kernels: {cpu['amp_C_path']}")
    gpus = [d for d in env["devices"] if d["device"].startswith("cuda")]
    if not gpus:
        why = ("torch is a CPU-only build" if v["torch_cuda"] is None
               else "CUDA build of torch, but torch.cuda.is_available() is False")
        lines.append(f"  GPUs: none checked ({why})")
    for gpu in gpus:
        cover = {True: "covered", False: "NOT covered", None: "unknown"}[gpu["amp_C_covers"]]
        lines.append(f"  {gpu['device']}: {gpu['name']} (capability {gpu['capability']}); "
                     f"amp_C code for it: {cover}")
    lines.append("  paths (device, op: path, why):")
    for device in env["devices"]:
        ops = device["ops"]
        if len(ops) > 1 and len({(op["path"], op["reason"]) for op in ops}) == 1:
            # One reason, said once; a missing amp_C's import error is above.
            reason = ops[0]["reason"] if ext["built"] else "amp_C is not built"
            ops = [{**ops[0], "op": f"all {len(ops)} ops", "reason": reason}]
        for op in ops:
            lines.append(f"    {device['device']:<7} {op['op']:<28} {op['path']:<6} {op['reason']}")
    return lines
