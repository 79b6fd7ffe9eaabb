"""The examples run end to end in their --smoke mode, as a user would run them, and learn.

Each one runs as a subprocess from the repository root with the repository on PYTHONPATH; a
smoke run exits 1 by itself when it did not learn, and prints "first ... last ..." lines that
are checked here as well.
"""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp_common import LEVELS

REPO = Path(__file__).resolve().parents[1]
TREND = re.compile(r"first(?: loss)? (\S+) last(?: loss)? (\S+)")


def run(*args, timeout=180):
    # One thread per process: these models are tiny, and on a small machine several intra-op
    # threads per process only contend (torchrun does the same for its workers).
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_succeeded_and_learned(result):
    assert result.returncode == 0, f"exit code {result.returncode}\n{result.stdout}\n{result.stderr}"
    trends = TREND.findall(result.stdout)
    assert trends, f"no 'first ... last ...' line in the output:\n{result.stdout}"
    for first, last in trends:
        assert float(last) < float(first), result.stdout


def summary_without_timing(stdout):
    """The simple example's last line, minus the wall-clock figure."""
    return re.sub(r"[\d.]+ ms/step", "", stdout.strip().splitlines()[-1])


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("opt_level", LEVELS)
def test_simple_smoke_learns_at_every_opt_level(opt_level):
    result = run("examples/simple/train.py", "--smoke", "--device", "cpu", "--opt-level", opt_level)
    assert_succeeded_and_learned(result)
    assert "test accuracy" in result.stdout


def test_simple_same_seed_gives_same_run_and_writes_plot(tmp_path):
    plot = tmp_path / "curves.png"
    args = ("examples/simple/train.py", "--smoke", "--device", "cpu", "--opt-level", "O1")
    first = run(*args, "--plot", str(plot))
    second = run(*args)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert summary_without_timing(first.stdout) == summary_without_timing(second.stdout)
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_dcgan_smoke_learns_and_writes_samples(opt_level, tmp_path):
    result = run("examples/dcgan/main_amp.py", "--smoke", "--device", "cpu", "--opt-level", opt_level,
                 "--outf", str(tmp_path))
    assert_succeeded_and_learned(result)
    assert (tmp_path / "fake_samples.png").stat().st_size > 0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradient_tricks_smoke_learns_and_resumes_exactly(opt_level):
    result = run("examples/gradient_tricks.py", "--smoke", "--device", "cpu", "--opt-level", opt_level)
    assert_succeeded_and_learned(result)
    assert len(TREND.findall(result.stdout)) == 5
    assert "resumed run matches the uninterrupted one exactly: True" in result.stdout


def test_distributed_smoke_learns_and_ranks_agree():
    result = run("-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                 f"--master_port={free_port()}", "examples/distributed/train_ddp.py",
                 "--smoke", "--device", "cpu")
    assert_succeeded_and_learned(result)
    assert "parameters identical on all 2 ranks: True" in result.stdout


FSDP2_PROBE = """
import sys, tempfile, torch, torch.distributed as dist
from amp._compat import FSDP2
if FSDP2 is None:
    sys.exit("torch has no FSDP2 (fully_shard)")
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/store", rank=0,
                        world_size=1)
try:
    FSDP2[0](torch.nn.Linear(2, 2))(torch.ones(1, 2))
except RuntimeError as error:
    sys.exit(str(error).splitlines()[0])
"""


def test_fsdp_smoke_learns_with_each_rank_holding_half_the_weights():
    probe = run("-c", FSDP2_PROBE)
    if probe.returncode != 0:
        pytest.skip(f"FSDP2 of torch {torch.__version__} does not run on CPU here: "
                    f"{probe.stderr.strip().splitlines()[-1]}")
    result = run("-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                 f"--master_port={free_port()}", "examples/fsdp/train_fsdp.py", "--smoke",
                 "--device", "cpu")
    assert_succeeded_and_learned(result)
    assert "rank 0 holds 8613 of 17226 fp32 weights" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("examples/simple/train.py", "--epochs", "0"),
     "error: argument --epochs: expected a positive integer, got 0"),
    (("examples/distributed/train_ddp.py", "--opt-level", "O9"),
     "error: argument --opt-level: invalid choice: 'O9'"),
])
def test_bad_argument_is_an_argparse_error(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
