"""Build the fused kernels as the extension ``amp_C`` when asked; the rest is in pyproject.toml.

The distribution ``amp-torch`` installs the packages ``amp`` and ``fp16_utils``. By default the
install is pure Python and needs no compiler. ``AMP_CPP_EXT=1`` builds ``amp_C`` with the CPU
kernels; ``AMP_CUDA_EXT=1`` adds the CUDA kernels. Both need the PyTorch you already have, so
build with ``pip install --no-build-isolation`` (from a checkout, ``.``; from the sdist of an
installed amp-torch, the command in docs/reference.md, "Building the fused kernels").

How the CUDA part is built: the ``.cu`` files include only the CUDA runtime and
``csrc/amp_C_kernels.h`` (raw pointers, sizes, dtype tags, an opaque stream), never PyTorch, so
we compile them with our own ``nvcc`` invocation whether PyTorch is a CPU or a CUDA build, and
link the objects into an ordinary ``CppExtension`` together with the CUDA runtime, statically
(``libcudart_static``), so that ``import amp_C`` works on machines without a GPU or a CUDA
install. The binding gets the current stream from PyTorch, which a CPU-only PyTorch cannot
give: built against one, the CUDA kernels are compiled and linked but CUDA tensors are refused
with a clear error (``amp_C.cuda_available()`` is then False).

Why the CUDA runtime is linked statically, not shared with torch as ``CUDAExtension`` links it
(``-lcudart``): two runtimes then live in one process, torch's and amp_C's, and we keep that.

* For static: amp_C runs with exactly the runtime of the toolkit whose nvcc compiled it (CUDA
  promises a runtime works on a newer driver, not that nvcc's code works on an older runtime of
  the same major, which a shared link to torch's runtime would ask). And ``import amp_C`` needs
  no CUDA library on the loader's path: a shared ``libcudart.so.13`` is found through amp_C's own
  rpath (torch's ``lib/`` holds no libcudart; pip's ``nvidia/cuda_runtime/lib``, conda's and the
  system's layouts differ) or only because torch loaded it first; a CPU-only torch (CI) has none.
* Two runtimes are safe here because what they share lives in the driver: each GPU's primary
  context (both runtimes use it), the current device (the driver's current context, which the
  binding sets with torch's device guard for the tensors' device) and streams (driver objects:
  amp_C launches on torch's current stream of that device). Each runtime keeps its own error
  state and module registrations, so amp_C's launch checks see amp_C's errors only.
  ``python -m amp.check`` proves this on each machine (its ``gpus`` section: a side stream, and
  with two GPUs each one's tensors with the other current; ``tools/gpu_check.sh`` runs it).
* A static runtime newer than the driver: within one major version CUDA's minor-version
  compatibility runs the SASS, but the driver cannot JIT-compile the newer PTX, so a GPU amp_C
  holds only PTX for fails its first launch there: amp's first-use self-test catches it (the
  PyTorch path, one ERROR), and ``python -m amp.check`` sets the three versions side by side.
  Across majors, the build refuses an nvcc whose major is not torch's.
* Lazy loading (``CUDA_MODULE_LOADING``, which torch sets to LAZY where unset): each runtime
  loads its own kernels into a context at their first launch there. amp's first-use self-test
  makes those first launches at ``amp.initialize``, not inside a captured CUDA graph;
  ``tools/gpu_check.sh`` also runs the checks with EAGER loading.

Environment: ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0;9.0+PTX"``) picks the GPU architectures;
otherwise the visible GPUs', or, without one, every architecture this nvcc supports from sm_80
up, with PTX of the highest either way (later GPUs JIT-compile it). The build ends with a line
naming the GPU code it made; at run time a GPU that code does not cover takes amp's PyTorch path
with a WARNING giving the ``TORCH_CUDA_ARCH_LIST`` to rebuild with. ``CUDA_HOME`` locates nvcc
(else ``PATH``). Only the CUDA major version must match PyTorch's. C++ sources are compiled by
PyTorch's ``BuildExtension`` (with ninja when present); the ``.cu`` files by parallel nvcc
processes.

``import amp_C`` works on its own, without importing torch first (Apex-era files start with it).
The extension needs torch's shared libraries (``libc10.so``, ``libtorch_cpu.so``, ...) and, before
any tensor crosses the binding, torch's Python types. So on Linux ``amp_C`` carries an rpath to
torch's ``lib/`` folder: ``$ORIGIN/torch/lib`` (installed, ``amp_C`` sits beside ``torch/`` in
site-packages, whichever machine the wheel was built on), then the ``lib/`` of the torch it was
built against (an in-place or editable build, or a venv that sees the system's torch); and its
module init imports torch first. When torch is already imported, its libraries are already
loaded and the rpath is not consulted, so nothing changes for code that imports torch first.
We chose this over renaming the extension behind a Python ``amp_C`` shim that imports torch:
the compiled module stays the one and only ``amp_C`` (a pure-Python install has none, so
``import amp_C`` raising ImportError keeps meaning "not built"), with no second name to keep in
step. Where neither rpath entry holds torch (amp_C and torch installed in different folders and
the build's torch gone), the loader reports ``libc10.so`` missing: import torch first, or rebuild.
"""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _env_flag(name):
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _find_cuda():
    """(nvcc, CUDA home): from $CUDA_HOME, else the nvcc on PATH (which may be a wrapper script)."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = Path(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if nvcc is None or not Path(nvcc).exists():
        raise RuntimeError(
            "AMP_CUDA_EXT=1 needs the CUDA compiler: nvcc was not found on PATH or in $CUDA_HOME/bin. "
            "Install the CUDA toolkit or set CUDA_HOME; use AMP_CPP_EXT=1 alone for the CPU kernels."
        )
    homes = [Path(cuda_home)] if cuda_home else [Path(nvcc).resolve().parent.parent, Path("/usr/local/cuda")]
    home = next((h for h in homes if (h / "include" / "cuda_runtime.h").exists()), None)
    if home is None:
        raise RuntimeError(f"found {nvcc} but no CUDA toolkit (include/cuda_runtime.h) in {homes}; set CUDA_HOME")
    return Path(nvcc), home


def _nvcc_version(nvcc):
    out = subprocess.check_output([str(nvcc), "--version"], text=True)
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"could not read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(match.group(1)), int(match.group(2))


def _check_cuda_major(torch, nvcc_version):
    # A CPU PyTorch has no CUDA runtime of its own to clash with.
    if torch.version.cuda is None:
        return
    torch_major = int(torch.version.cuda.split(".")[0])
    if torch_major != nvcc_version[0]:
        raise RuntimeError(
            f"nvcc is CUDA {nvcc_version[0]}.{nvcc_version[1]} but PyTorch was built with CUDA "
            f"{torch.version.cuda}; their major versions must match. Point CUDA_HOME at a CUDA "
            f"{torch_major}.x toolkit."
        )


def _arch_list(torch, nvcc):
    """The `X.Y[+PTX]` architectures to build for: TORCH_CUDA_ARCH_LIST as given; else the visible
    GPUs', or every one this nvcc supports from sm_80 up; then with PTX of the highest, so that a
    later GPU JIT-compiles the kernels instead of taking the PyTorch path (a build on an A100 then
    also runs on an H100)."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";")
    archs = [a for a in requested.split(";") if a]
    if archs:
        return archs
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        archs = [f"{major}.{minor}" for major, minor in sorted(caps)]
    else:
        listed = subprocess.check_output([str(nvcc), "--list-gpu-arch"], text=True).split()
        numbers = sorted({int(a.split("_")[1]) for a in listed if re.fullmatch(r"compute_\d+", a)})
        archs = [f"{n // 10}.{n % 10}" for n in numbers if n >= 80]
        if not archs:
            raise RuntimeError(f"{nvcc} compiles for no GPU from sm_80 up ({' '.join(listed)}); set "
                               "TORCH_CUDA_ARCH_LIST to the architectures you want")
    return archs[:-1] + [archs[-1] + "+PTX"]


def _gencode_flags(archs):
    """nvcc's -gencode flags: SASS of each architecture, and PTX where `+PTX` asks for it. PTX is
    always the plain architecture's (`9.0a+PTX` ships compute_90): arch- and family-specific PTX
    (compute_90a, compute_100f) would JIT only on that architecture or family, not on later GPUs."""
    flags = []
    for arch in archs:
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", arch)
        if match is None:
            raise RuntimeError(
                f"TORCH_CUDA_ARCH_LIST entry {arch!r} is not of the form 8.0, 9.0a or 8.6+PTX"
            )
        plain = match.group(1) + match.group(2)
        number = plain + match.group(3)
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if match.group(4):
            flags.append(f"-gencode=arch=compute_{plain},code=compute_{plain}")
    return flags


def _images(gencode):
    """The GPU code the flags produce (sm_80, compute_90, ...), as amp_C.build_info() reports it."""
    return [flag.rsplit("code=", 1)[1] for flag in gencode]


def _images_note(images):
    """What the build says at its end: the GPU code amp_C holds, and what other GPUs do."""
    ptx = [image for image in images if image.startswith("compute_")]
    later = (f"GPUs after {', '.join(ptx)} JIT-compile its PTX when they first load it" if ptx
             else "no PTX: later GPUs are not covered")
    return (f"amp_C: CUDA kernels built for {', '.join(images)} ({later}). A GPU this code does not "
            "cover takes amp's PyTorch path (same results, slower, and a warning at run time); to add "
            'it, rebuild with it in TORCH_CUDA_ARCH_LIST (e.g. "7.5;8.0;9.0+PTX" for a T4, an A100 '
            "and an H100 and later GPUs).")


def _another_distributions_amp_C():
    """``(distribution, path)`` of an installed top-level ``amp_C`` that is not ours, or None.

    NVIDIA Apex installs its own ``amp_C``; installing ours would overwrite that file.
    """
    from importlib import metadata

    for dist in metadata.distributions():
        if re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower() == "amp-torch":
            continue
        for file in dist.files or ():
            if len(file.parts) == 1 and file.name.startswith("amp_C.") and file.suffix in (".so", ".pyd"):
                return dist.metadata["Name"], dist.locate_file(file)
    return None


def _amp_C_extension(with_cuda):
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as err:
        raise RuntimeError(
            "AMP_CPP_EXT=1 / AMP_CUDA_EXT=1 build amp_C against your installed PyTorch, which could "
            "not be imported. Install torch first, then build with pip's --no-build-isolation (an "
            "isolated build sees no torch): `pip install --no-build-isolation .` in a checkout."
        ) from err

    cpp_sources = [CSRC / "amp_C_frontend.cpp", CSRC / "amp_C_ops.cpp", CSRC / "amp_C_contract.cpp",
                   *sorted((CSRC / "cpu").glob("*.cpp"))]
    cuda_sources = sorted(CSRC.glob("*.cu")) if with_cuda else []
    missing = [str(p) for p in cpp_sources[:3] if not p.exists()]
    if missing or len(cpp_sources) == 3 or (with_cuda and not cuda_sources):
        raise RuntimeError(f"amp_C sources are missing under {CSRC} (is this a complete checkout?)")

    # -ffp-contract=off: axpby must round each product before the add (no FMA), bit for bit like
    # the CUDA kernels and the pure-torch fallback. -fno-math-errno: sqrtf need not set errno, so
    # Adam's loop vectorises (results are unchanged).
    cxx_flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
    link_flags = []
    if sys.platform.startswith("linux"):
        # The loader reads $ORIGIN itself: the link is spawned without a shell, so it stays literal.
        torch_lib = Path(torch.__file__).resolve().parent / "lib"
        link_flags += ["-Wl,-rpath,$ORIGIN/torch/lib", f"-Wl,-rpath,{torch_lib}"]
    if torch._C.has_openmp:  # at::parallel_for is OpenMP inside our own code
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    include_dirs = [str(CSRC)]
    nvcc = None
    if with_cuda:
        nvcc, cuda_home = _find_cuda()
        nvcc_version = _nvcc_version(nvcc)
        _check_cuda_major(torch, nvcc_version)
        # build_info() reports the runtime linked in (the toolkit's, as nvcc's): python -m amp.check
        # sets it beside torch's and the driver's.
        cxx_flags += ["-DAMP_WITH_CUDA_KERNELS", f"-DAMP_CUDA_RUNTIME={nvcc_version[0]}.{nvcc_version[1]}"]
        if torch.version.cuda is not None:
            cxx_flags.append("-DAMP_WITH_TORCH_CUDA")
            include_dirs.append(str(cuda_home / "include"))
        lib_dir = next((d for d in (cuda_home / "lib64", cuda_home / "lib") if (d / "libcudart_static.a").exists()), None)
        if lib_dir is None:
            raise RuntimeError(f"libcudart_static.a was not found under {cuda_home}/lib64 or /lib")
        link_flags += [f"-L{lib_dir}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]

    class BuildAmpC(BuildExtension):
        """BuildExtension that first compiles the .cu files with nvcc and links their objects."""

        def build_extensions(self):
            clash = None if self.inplace else _another_distributions_amp_C()
            if clash is not None:
                raise RuntimeError(
                    f"{clash[0]} installed its own amp_C ({clash[1]}); installing amp-torch's would overwrite "
                    "that file. amp does not need it: install amp without AMP_CPP_EXT/AMP_CUDA_EXT (it "
                    "then uses its PyTorch ops, with the same results), or build amp_C in a separate "
                    "environment, or in place in a checkout (python setup.py build_ext --inplace).")
            images = []
            if cuda_sources:
                gencode = _gencode_flags(_arch_list(torch, nvcc))
                objects = self._compile_cuda(Path(self.build_temp) / "amp_C_cuda", gencode)
                # amp_C.build_info() reports the images (sm_80, compute_90, ...), so that amp can
                # tell whether they cover a GPU before it launches anything there.
                images = _images(gencode)
                for ext in self.extensions:
                    ext.extra_objects = list(ext.extra_objects or []) + objects
                    ext.extra_compile_args = list(ext.extra_compile_args) + [
                        f"-DAMP_CUDA_IMAGES={','.join(images)}"]
            super().build_extensions()
            if images:
                print(_images_note(images), flush=True)

        def _compile_cuda(self, out_dir, gencode):
            out_dir.mkdir(parents=True, exist_ok=True)
            # -fmad=false: no multiply-add contraction, so every kernel rounds as its CPU twin does
            # (l2norm's acc += u * u is the one expression nvcc would otherwise fuse).
            flags = ["-std=c++17", "-O3", "-fmad=false", "-lineinfo", "-Xcompiler", "-fPIC", f"-I{CSRC}",
                     *gencode]

            def compile_one(source):
                obj = out_dir / (source.stem + ".o")
                cmd = [str(nvcc), *flags, "-c", str(source), "-o", str(obj)]
                print(" ".join(cmd), flush=True)
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"nvcc failed on {source.name}:\n{result.stdout}{result.stderr}")
                return str(obj)

            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                return list(pool.map(compile_one, cuda_sources))

    ext = CppExtension(
        name="amp_C",
        sources=[str(p.relative_to(ROOT)) for p in cpp_sources],
        include_dirs=include_dirs,
        extra_compile_args=cxx_flags,
        extra_link_args=link_flags,
    )
    return [ext], {"build_ext": BuildAmpC}


# Build frontends run this file as __main__ (pip through setuptools.build_meta, `python setup.py`);
# tests import it for the helpers above.
if __name__ == "__main__":
    ext_modules, cmdclass = [], {}
    if _env_flag("AMP_CPP_EXT") or _env_flag("AMP_CUDA_EXT"):
        ext_modules, cmdclass = _amp_C_extension(with_cuda=_env_flag("AMP_CUDA_EXT"))

    # Everything else (name, version, dependencies, packages) is declared in pyproject.toml.
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
