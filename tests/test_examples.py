"""The examples run end to end in their --smoke mode, as a user would run them, and learn.

Each one runs as a subprocess from the repository root with the repository on PYTHONPATH; a
smoke run exits 1 by itself when it did not learn, and prints "first ... last ..." lines that
are checked here as well.
"""
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from amp_common import LEVELS, load_script

REPO = Path(__file__).resolve().parents[1]
TREND = re.compile(r"first(?: loss)? (\S+) last(?: loss)? (\S+)")
SKIPPED = re.compile(r"(\d+) of (\d+) steps skipped")  # the simple example's count, from amp.skipped_steps


curves = load_script("examples/simple/curves.py")


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


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", LEVELS)
def test_simple_smoke_learns_at_every_opt_level(opt_level):
    result = run("examples/simple/train.py", "--smoke", "--device", "cpu", "--opt-level", opt_level)
    assert_succeeded_and_learned(result)
    assert "test accuracy" in result.stdout


@pytest.mark.slow
def test_simple_same_seed_gives_same_run_and_writes_plot(tmp_path):
    plot = tmp_path / "curves.png"
    args = ("examples/simple/train.py", "--smoke", "--device", "cpu", "--opt-level", "O1")
    first = run(*args, "--plot", str(plot))
    second = run(*args)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert summary_without_timing(first.stdout) == summary_without_timing(second.stdout)
    assert 10_000 < plot.stat().st_size < 150_000
    image = matplotlib.image.imread(plot)  # decodes the whole PNG
    assert image.shape[:2] == (480, 700)  # curves.save_plot: 7 x 4.8 inches at 100 dpi
    assert image.std() > 0.05  # not a blank canvas


# Runs the simple example with --plot and prints, as JSON, the History its picture is drawn from.
PLOTTED_HISTORY = """
import dataclasses, json, sys
sys.path.insert(0, "examples/simple")
import curves, train
drawn = []
save_plot = curves.save_plot
def spy(history, path, title):
    drawn.append(history)
    save_plot(history, path, title)
curves.save_plot = spy
status = train.main(sys.argv[1:])
print(json.dumps(dataclasses.asdict(drawn[0])))
sys.exit(status)
"""


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [
    32,  # the default: its smoke run skips one step here, and stays in the first epoch
    200,  # 7 steps an epoch: the 25 smoke steps cross 3 epoch boundaries
])
def test_simple_plot_is_drawn_from_every_step_its_skips_and_epochs(batch_size, tmp_path):
    plot = tmp_path / "curves.png"
    result = run("-c", PLOTTED_HISTORY, "--smoke", "--device", "cpu", "--opt-level", "O2",
                 "--batch-size", str(batch_size), "--plot", str(plot))
    assert result.returncode == 0, result.stdout + result.stderr
    history = json.loads(result.stdout.strip().splitlines()[-1])
    skipped, total = (int(n) for n in SKIPPED.search(result.stdout).groups())

    assert len(history["losses"]) == len(history["scales"]) == len(history["applied"]) == total == 25
    skipped_steps = [step for step, applied in enumerate(history["applied"]) if not applied]
    assert len(skipped_steps) == skipped
    # O2's dynamic scale starts at 2**16 and halves on every overflow: the skips are the drops.
    scale_before = [2.0**16] + history["scales"][:-1]
    assert skipped_steps == [step for step in range(total) if history["scales"][step] < scale_before[step]]
    steps_per_epoch = 1437 // batch_size
    assert history["epoch_starts"] == list(range(steps_per_epoch, total, steps_per_epoch))
    assert plot.stat().st_size > 0


def test_curves_mark_skipped_steps_and_epoch_boundaries_on_both_panels():
    history = curves.History(losses=[2.0, 1.5, 1.4, 1.0, 0.8, 0.5],
                             scales=[4.0, 4.0, 2.0, 2.0, 1.0, 1.0],
                             applied=[True, True, False, True, False, True], epoch_starts=[3])
    ax_loss, ax_scale = curves.draw(history, "title").axes

    def line(ax, label=None, xdata=None):
        """The first line drawn on ``ax`` with this label and / or these x values."""
        for candidate in ax.get_lines():
            if label in (None, candidate.get_label()) and xdata in (None, list(candidate.get_xdata())):
                return candidate
        raise AssertionError(f"no line labelled {label!r} at x = {xdata} on {ax.get_ylabel()!r}")

    loss_skips = line(ax_loss, "skipped step (2)")
    assert list(loss_skips.get_xdata()) == [3, 5]  # steps are numbered from 1 in the picture
    assert list(loss_skips.get_ydata()) == [1.4, 0.8]
    assert list(line(ax_scale, xdata=[3, 5]).get_ydata()) == [2.0, 1.0]
    assert list(line(ax_loss, "loss").get_ydata()) == history.losses
    for ax in (ax_loss, ax_scale):
        assert line(ax, xdata=[3.5, 3.5]).get_linestyle() == "--"  # between steps 3 and 4


def test_curves_smoothed_loss_is_bias_corrected_and_passes_over_non_finite_losses():
    assert curves.exponential_moving_average([2.0, 2.0, math.inf, 2.0, math.nan]) == pytest.approx([2.0] * 5)


def test_curves_history_needs_one_entry_per_step():
    with pytest.raises(ValueError, match="one entry per step"):
        curves.History(losses=[1.0, 0.5], scales=[1.0], applied=[True, True])


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_dcgan_smoke_learns_and_writes_samples(opt_level, tmp_path):
    result = run("examples/dcgan/main_amp.py", "--smoke", "--device", "cpu", "--opt-level", opt_level,
                 "--outf", str(tmp_path))
    assert_succeeded_and_learned(result)
    assert (tmp_path / "fake_samples.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradient_tricks_smoke_learns_and_resumes_exactly(opt_level):
    result = run("examples/gradient_tricks.py", "--smoke", "--device", "cpu", "--opt-level", opt_level)
    assert_succeeded_and_learned(result)
    assert len(TREND.findall(result.stdout)) == 5
    assert "resumed run matches the uninterrupted one exactly: True" in result.stdout


@pytest.mark.slow
def test_distributed_smoke_learns_and_ranks_agree():
    result = run("-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                 f"--master_port={free_port()}", "examples/distributed/train_ddp.py",
                 "--smoke", "--device", "cpu")
    assert_succeeded_and_learned(result)
    assert "parameters identical on all 2 ranks: True" in result.stdout


FSDP2_PROBE = """
import sys, tempfile, torch, torch.distributed as dist
from amp._compat import fsdp2
if fsdp2() is None:
    sys.exit("torch has no FSDP2 (fully_shard)")
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/store", rank=0,
                        world_size=1)
try:
    fsdp2()[0](torch.nn.Linear(2, 2))(torch.ones(1, 2))
except RuntimeError as error:
    sys.exit(str(error).splitlines()[0])
"""


@pytest.mark.slow
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


@pytest.mark.slow
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
