"""setup.py's build of amp_C: where it meets another distribution's files, and the GPU code it makes."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import amp.multi_tensor_apply as mta
from amp_common import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_building_amp_C_to_install_refuses_to_overwrite_nvidia_apexs_amp_C(tmp_path):
    # An environment where NVIDIA Apex installed its own amp_C (only its metadata is needed).
    site = tmp_path / "site"
    record = site / "apex-0.1.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 0.1\n")
    (record / "RECORD").write_text("amp_C.cpython-311-x86_64-linux-gnu.so,,\napex/__init__.py,,\n")
    env = dict(os.environ, AMP_CPP_EXT="1", PYTHONPATH=str(site))
    build_temp = tmp_path / "temp"
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(build_temp)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "apex installed its own amp_C" in result.stderr + result.stdout
    assert "amp_C.cpython-311-x86_64-linux-gnu.so" in result.stderr + result.stdout
    assert not list(build_temp.rglob("*.o"))  # refused before compiling anything


# ---- the GPU architectures amp_C is built for (issue 27 item 2) ------------------------------------

setup_py = load_script("setup.py")


def fake_torch(*capabilities):
    """A torch whose CUDA sees GPUs of ``capabilities`` (none: no GPU)."""
    cuda = types.SimpleNamespace(is_available=lambda: bool(capabilities), device_count=lambda: len(capabilities),
                                 get_device_capability=lambda index: capabilities[index])
    return types.SimpleNamespace(cuda=cuda)


@pytest.fixture
def nvcc_13(tmp_path):
    """An nvcc that lists CUDA 13.0's architectures, in its order."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho compute_75 compute_80 compute_86 compute_87 compute_88 compute_89 "
                    "compute_90 compute_100 compute_110 compute_103 compute_120 compute_121\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.mark.parametrize("requested, archs", [
    ("8.0;9.0+PTX", ["8.0", "9.0+PTX"]), ("8.0 8.6", ["8.0", "8.6"]), ("9.0a", ["9.0a"])])
def test_torch_cuda_arch_list_is_built_as_given(monkeypatch, nvcc_13, requested, archs):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", requested)
    assert setup_py._arch_list(fake_torch((8, 0)), nvcc_13) == archs


def test_a_build_on_a_gpu_machine_adds_ptx_of_the_highest_visible_gpu(monkeypatch, nvcc_13):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert setup_py._arch_list(fake_torch((8, 6), (8, 0), (8, 6)), nvcc_13) == ["8.0", "8.6+PTX"]


def test_a_build_without_a_gpu_covers_sm_80_up_with_ptx_of_the_newest(monkeypatch, nvcc_13):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert setup_py._arch_list(fake_torch(), nvcc_13) == [
        "8.0", "8.6", "8.7", "8.8", "8.9", "9.0", "10.0", "10.3", "11.0", "12.0", "12.1+PTX"]


def test_ptx_of_an_arch_specific_entry_is_the_plain_architecture_s():
    flags = setup_py._gencode_flags(["8.0", "9.0a+PTX", "10.0f"])
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                     "-gencode=arch=compute_90,code=compute_90", "-gencode=arch=compute_100f,code=sm_100f"]
    images = setup_py._images(flags)
    assert images == ["sm_80", "sm_90a", "compute_90", "sm_100f"]
    # amp's run-time rule then finds a later GPU covered by the PTX, as the build's last line says.
    assert mta.covers(images, (12, 0)) is True and mta.covers(setup_py._images(flags[:2]), (12, 0)) is False
    note = setup_py._images_note(images)
    assert note.startswith("amp_C: CUDA kernels built for sm_80, sm_90a, compute_90, sm_100f (GPUs after "
                           "compute_90 JIT-compile its PTX")
    assert "no PTX" in setup_py._images_note(["sm_80"]) and "TORCH_CUDA_ARCH_LIST" in note


def test_an_entry_of_another_form_is_refused_by_name():
    with pytest.raises(RuntimeError, match="'Ampere' is not of the form"):
        setup_py._gencode_flags(["Ampere"])
