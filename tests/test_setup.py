"""setup.py's build of amp_C, where it meets another distribution's files."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
