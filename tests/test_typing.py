"""Both packages ship their ``py.typed`` marker (PEP 561), so type checkers read their annotations.

That the annotations themselves check is CI's mypy step (``.ci/run``, configured in pyproject.toml).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_both_packages_ship_py_typed(tmp_path):
    # build_py lays out exactly the package files that a wheel (and a plain install) carries.
    env = {key: value for key, value in os.environ.items() if key not in ("AMP_CPP_EXT", "AMP_CUDA_EXT")}
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for package in ("amp", "fp16_utils"):
        assert (REPO / package / "py.typed").is_file()
        assert (tmp_path / package / "py.typed").is_file(), f"{package}/py.typed is not installed"
