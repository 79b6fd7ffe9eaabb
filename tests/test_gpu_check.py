"""tools/gpu_check.sh stops clearly without a GPU, and its summary reads the phases' logs right.

The GPU phases themselves run only on a GPU machine; here the script is run where PyTorch sees
no GPU, and the summary is built from small logs written in the formats the phases produce.
"""
import argparse
import json
import math
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import amp.check as amp_check
from amp import _pytorch_ops as _torch_ops
from amp_common import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"


summary = load_script("tools/gpu_check_summary.py")

DEVICE = "NVIDIA H100 80GB HBM3 (capability 9.0); torch 2.11.0+cu130 (CUDA 13.0); Python 3.12.3"
BUILD_OK = f"""gpu_check: device {DEVICE}
nvcc -gencode=arch=compute_90,code=sm_90 -c csrc/multi_tensor_scale.cu
gpu_check: phase build exit 0 after 95 s
amp_C /repo/amp_C.cpython-312-x86_64-linux-gnu.so cuda_available() True
gpu_check: phase amp_C exit 0 after 2 s
"""
SYNC_FREE = "tests/test_sync_free.py::test_cuda_fused_step_has_no_sync"
CUDA_TESTS_OK = f"""........                                                                 [100%]
=========================== short test summary info ============================
PASSED tests/test_amp_C.py::test_cuda_matches_cpu_bitwise
PASSED {SYNC_FREE}[O1]
PASSED {SYNC_FREE}[O2]
PASSED {SYNC_FREE}[O5]
8 passed, 700 deselected in 20.10s
gpu_check: phase cuda_tests exit 0 after 31 s
"""
CPU_SUITE_OK = """...s....                                                                 [100%]
=========================== short test summary info ============================
PASSED tests/test_scaler.py::test_growth
SKIPPED [1] tests/test_amp_C.py:20: needs a CUDA GPU
690 passed, 1 skipped, 8 deselected in 150.02s (0:02:30)
gpu_check: phase cpu_suite exit 0 after 151 s
"""
UNSCALE_OK = """unscale fp16 grads -> fp32 master grads, with overflow check
  amp_C.multi_tensor_scale                                       0.06 ms   ours is  1.00x faster
  speed-up over (a): 1.80x (goal >= 1.5); fraction of the copy limit (b): 0.91 (goal >= 0.8)
gpu_check: phase unscale exit 0 after 12 s
"""
FUSED_OPS_OK = """op and form                                                    B/param kernel ms  copy ms of copy fallback ms speed-up
sgd: float16 grads, float32 params+state, float16 model copy        20      0.30     0.27    0.90        12.0    40.0x
adam: float16 grads, float32 params+state, float16 model copy       28      0.40     0.36    0.90        30.0    75.0x
gpu_check: phase fused_ops exit 0 after 30 s
"""
TRAIN_STEP_OK = "gpu: medians over rounds\ngpu_check: phase train_step exit 0 after 60 s\n"
CHECK_OK = "amp.check: PASSED: 26 passed, 0 failed, 0 skipped in 41.0 s\ngpu_check: phase check exit 0 after 48 s\n"
CHECK_EAGER_OK = "amp.check: PASSED: 12 passed, 0 failed, 0 skipped in 9.0 s\ngpu_check: phase check_eager exit 0 after 12 s\n"


SECOND_GPU = [f"first-use self-test, {summary.OTHER_CURRENT}", f"O2 step, {summary.OTHER_CURRENT}"]


def check_report(gpus=1, **statuses):
    """check.json with every check passed on cpu and ``gpus`` GPUs, but ``statuses[(check, device)]``."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(gpus)]
    results = []
    for device in devices:
        checks = ["multi_tensor_scale", "multi_tensor_adam", "O2 step", "unscale timing"]
        if device != "cpu":
            checks += ["current stream"] + (SECOND_GPU if gpus > 1 else [])
        for check in checks:
            status = statuses.get(f"{check}@{device}", "pass")
            ratio = 2.5 if check == "unscale timing" and status == "pass" else None
            results.append({"check": check, "device": device, "status": status, "cases": 3,
                            "detail": f"{status} detail", "seconds": 0.1, "ratio": ratio})
    return json.dumps({"passed": "fail" not in statuses.values(), "results": results,
                       "versions": {"torch_cuda": "13.0", "cuda_driver": "13.1"},
                       "amp_C": {"cuda_runtime": "13.0"}, "devices": [{"device": d} for d in devices]})


def train_step_report(o2_step=9.0, o2_peak=900.0, remainders_overhead=0.8):
    rows = {"autocast fp16 + GradScaler": {"step_ms": 10.0, "overhead_ms": 1.0, "peak_mib": 1000.0},
            "amp O2 (fp16)": {"step_ms": o2_step, "overhead_ms": 0.9, "peak_mib": o2_peak},
            "autocast bf16": {"step_ms": 10.0, "overhead_ms": 1.0, "peak_mib": 1000.0},
            "amp O5 + FusedAdam, remainders": {"step_ms": 9.0, "overhead_ms": remainders_overhead,
                                               "peak_mib": 880.0}}
    return json.dumps({"device": "NVIDIA H100", "workloads": {"gpt": rows}})


def write_logs(out, **logs):
    defaults = {"build.log": BUILD_OK, "check.log": CHECK_OK, "check.json": check_report(),
                "check_eager.log": CHECK_EAGER_OK, "check_eager.json": check_report(),
                "cuda_tests.log": CUDA_TESTS_OK, "cpu_suite.log": CPU_SUITE_OK,
                "unscale.log": UNSCALE_OK, "fused_ops.log": FUSED_OPS_OK, "train_step.log": TRAIN_STEP_OK,
                "train_step.json": train_step_report()}
    for name, text in defaults.items():
        text = logs.get(name.replace(".", "_"), text)
        if text is not None:
            (out / name).write_text(text)


def failed(log, phase, last_line):
    """``log`` with ``phase`` printing ``last_line`` and exiting with 1."""
    return log.replace(f"gpu_check: phase {phase} exit 0", f"{last_line}\ngpu_check: phase {phase} exit 1")


def statuses(out):
    rows, _, _ = summary.summarize(out)
    return {row.check: row.status for row in rows}


def row(out, prefix):
    rows, _, _ = summary.summarize(out)
    (match,) = [r for r in rows if r.check.startswith(prefix)]
    return match


@pytest.mark.slow
def test_without_a_gpu_the_script_exits_with_a_message_and_builds_nothing(tmp_path):
    # A python wrapper records every invocation, so that a build attempt cannot go unnoticed.
    calls = tmp_path / "calls"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(wrapper), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no CUDA GPU is visible to PyTorch" in result.stderr
    assert "setup.py" not in calls.read_text()
    table = (out / "summary.md").read_text()
    assert table.count("| not run |") == 11 and "| met |" not in table


@pytest.mark.slow
def test_the_script_without_an_output_folder_prints_its_usage():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "usage: bash tools/gpu_check.sh OUT_DIR" in result.stderr


def test_all_goals_met_gives_every_row_met_and_exit_0(tmp_path, capsys):
    write_logs(tmp_path)
    assert set(statuses(tmp_path).values()) == {summary.MET}
    assert summary.main(["gpu_check_summary.py", str(tmp_path)]) == 0
    written = (tmp_path / "summary.md").read_text()
    assert written == capsys.readouterr().out
    assert f"Device: {DEVICE}" in written and "| 1.80x faster | >= 1.5 | met |" in written


def test_missing_logs_are_not_run_and_the_exit_is_1(tmp_path):
    write_logs(tmp_path, unscale_log=None, train_step_log=None, train_step_json=None, cpu_suite_log=None)
    assert row(tmp_path, "unscale: amp_C vs copy_").status == summary.NOT_RUN
    assert row(tmp_path, "train_step").status == summary.NOT_RUN
    cpu = row(tmp_path, "CPU suite")
    assert cpu.status == summary.NOT_RUN and "no record of phase cpu_suite" in cpu.result
    assert row(tmp_path, "CUDA tests").status == summary.MET
    assert summary.main(["gpu_check_summary.py", str(tmp_path)]) == 1


def test_failed_cuda_tests_and_a_failed_sync_free_case_are_not_met(tmp_path):
    log = CUDA_TESTS_OK.replace(f"PASSED {SYNC_FREE}[O2]", f"FAILED {SYNC_FREE}[O2] - RuntimeError: sync")
    log = log.replace("8 passed,", "7 passed, 1 failed,").replace("exit 0 after 31", "exit 1 after 31")
    write_logs(tmp_path, cuda_tests_log=log)
    cuda = row(tmp_path, "CUDA tests")
    assert cuda.status == summary.NOT_MET and "7 passed, 1 failed" in cuda.result
    sync_free = row(tmp_path, "no host sync")
    assert sync_free.status == summary.NOT_MET and sync_free.result == "2 of 3 cases passed"


def test_a_skipped_sync_free_test_is_not_run(tmp_path):
    log = "sss\nSKIPPED [3] tests/test_sync_free.py:219: needs a CUDA GPU\n3 skipped in 0.79s\n"
    write_logs(tmp_path, cuda_tests_log=log + "gpu_check: phase cuda_tests exit 0 after 2 s\n")
    assert row(tmp_path, "no host sync").status == summary.NOT_RUN
    assert row(tmp_path, "CUDA tests").status == summary.NOT_MET  # nothing passed


def test_a_timed_out_test_phase_is_not_met_with_its_partial_counts(tmp_path):
    log = CPU_SUITE_OK.replace("exit 0 after 151", "exit 124 after 200")
    write_logs(tmp_path, cpu_suite_log=log)
    cpu = row(tmp_path, "CPU suite")
    assert cpu.status == summary.NOT_MET and "timed out after 200 s" in cpu.result


def test_a_failed_build_names_its_last_output_line(tmp_path):
    write_logs(tmp_path, build_log=failed(BUILD_OK, "build", "RuntimeError: nvcc failed on x.cu"))
    build = row(tmp_path, "amp_C built")
    assert build.status == summary.NOT_MET and "nvcc failed on x.cu" in build.result


@pytest.mark.parametrize("speedup, fraction, expected", [
    ("1.80", "0.91", ("met", "met")),
    ("1.20", "0.91", ("not met", "met")),
    ("1.80", "0.70", ("met", "not met")),
])
def test_unscale_ratios_are_checked_against_the_issue_goals(tmp_path, speedup, fraction, expected):
    log = UNSCALE_OK.replace("(a): 1.80x", f"(a): {speedup}x").replace("(b): 0.91", f"(b): {fraction}")
    write_logs(tmp_path, unscale_log=log)
    assert (row(tmp_path, "unscale: amp_C vs copy_").status,
            row(tmp_path, "unscale: amp_C vs a plain").status) == expected


def test_unscale_ratios_printed_before_a_crash_still_count(tmp_path):
    write_logs(tmp_path, unscale_log=failed(UNSCALE_OK, "unscale", "RuntimeError: l2norm failed"))
    unscale = row(tmp_path, "unscale: amp_C vs copy_")
    assert unscale.status == summary.MET and "l2norm failed" in unscale.result


def test_unscale_output_without_the_ratio_line_is_not_run(tmp_path):
    write_logs(tmp_path, unscale_log="something else\ngpu_check: phase unscale exit 0 after 3 s\n")
    unscale = row(tmp_path, "unscale: amp_C vs copy_")
    assert unscale.status == summary.NOT_RUN and "no ratio" in unscale.result


def test_o2_slower_or_larger_than_gradscaler_is_not_met(tmp_path):
    write_logs(tmp_path, train_step_json=train_step_report(o2_step=11.0, o2_peak=1100.0))
    step, peak = row(tmp_path, "train_step gpt: O2 step"), row(tmp_path, "train_step gpt: O2 peak")
    assert (step.status, peak.status) == (summary.NOT_MET, summary.NOT_MET)
    assert step.result == "1.10x (11.00 ms vs 10.00 ms)"


def test_o5_remainders_post_backward_slower_than_autocast_bf16_is_not_met(tmp_path):
    write_logs(tmp_path, train_step_json=train_step_report(remainders_overhead=1.2))
    overhead = row(tmp_path, "train_step gpt: O5 remainders post-backward")
    assert overhead.status == summary.NOT_MET and overhead.result == "1.20x (1.20 ms vs 1.00 ms)"
    assert row(tmp_path, "train_step gpt: O5 remainders peak").status == summary.MET


def test_unmeasured_peak_memory_is_not_run(tmp_path):
    write_logs(tmp_path, train_step_json=train_step_report(o2_peak=None))
    assert row(tmp_path, "train_step gpt: O2 peak").status == summary.NOT_RUN
    assert row(tmp_path, "train_step gpt: O2 step").status == summary.MET


def test_left_out_test_files_are_listed_with_the_missing_package(tmp_path):
    note = "gpu_check: not run: tests/test_examples.py (sklearn is not installed)\n"
    write_logs(tmp_path, cpu_suite_log=note + CPU_SUITE_OK, cuda_tests_log=note + CUDA_TESTS_OK,
               check_json=check_report(gpus=2))
    _, notes, markdown = summary.summarize(tmp_path)
    assert notes == ["tests/test_examples.py (sklearn is not installed)"]
    assert "- tests/test_examples.py (sklearn is not installed)" in markdown


def test_the_summary_reads_the_ratios_unscale_benchmark_prints(tmp_path, monkeypatch, capsys):
    # amp_C's pure-PyTorch twins stand in for the extension: only the printed format matters here.
    fake_amp_C = types.SimpleNamespace(cuda_available=lambda: False, **{
        name: getattr(_torch_ops, name) for name in ("multi_tensor_scale", "multi_tensor_l2norm")})
    monkeypatch.setitem(sys.modules, "amp_C", fake_amp_C)
    unscale = load_script("benchmarks/unscale.py")
    monkeypatch.setattr(unscale, "gpt_ish_shapes", lambda: [(64, 32), (32,)])
    monkeypatch.setattr(sys, "argv", ["unscale.py", "--reps", "1"])
    unscale.main()
    write_logs(tmp_path, unscale_log=capsys.readouterr().out + "gpu_check: phase unscale exit 0 after 1 s\n")
    for check in ("unscale: amp_C vs copy_", "unscale: amp_C vs a plain"):
        assert row(tmp_path, check).status in (summary.MET, summary.NOT_MET)


def test_the_summary_reads_the_json_train_step_writes(tmp_path):
    train_step = load_script("benchmarks/train_step.py")
    table = {name: {"step": 0.01, "overhead": 0.001, "peak": math.nan} for name in train_step.CONFIGS}
    table["amp O2 (fp16)"]["step"] = 0.008
    train_step.write_json(tmp_path / "train_step.json", torch.device("cpu"),
                          argparse.Namespace(size="small"), {"cnn": table})
    write_logs(tmp_path, train_step_json=None)
    assert row(tmp_path, "train_step cnn: O2 step").result == "0.80x (8.00 ms vs 10.00 ms)"
    assert row(tmp_path, "train_step cnn: O2 peak").status == summary.NOT_RUN


def test_a_train_step_json_without_the_compared_configs_is_not_run(tmp_path):
    write_logs(tmp_path, train_step_json=json.dumps({"workloads": {"gpt": {"fp32": {}}}}))
    train = row(tmp_path, "train_step")
    assert train.status == summary.NOT_RUN and "not what this summary reads" in train.result


def test_a_fused_kernel_below_the_copy_goal_is_not_met_and_a_missing_log_not_run(tmp_path):
    write_logs(tmp_path, fused_ops_log=FUSED_OPS_OK.replace("0.90", "0.50", 1))
    assert row(tmp_path, "fused sgd").status == summary.NOT_MET
    assert row(tmp_path, "fused adam").status == summary.MET
    write_logs(tmp_path, fused_ops_log=None)
    (tmp_path / "fused_ops.log").unlink()
    assert row(tmp_path, "fused optimizer kernels").status == summary.NOT_RUN


def test_amp_check_passing_on_the_gpu_is_met_with_its_unscale_ratio(tmp_path):
    write_logs(tmp_path)
    check = row(tmp_path, "amp.check")
    assert check.status == summary.MET
    assert check.result == "9 passed, 0 failed, 0 skipped; unscale 2.50x PyTorch's on cuda:0"


def test_amp_check_failures_are_not_met_and_named_with_their_device(tmp_path):
    report = check_report(**{"multi_tensor_adam@cuda:0": "fail", "O2 step@cuda:0": "fail"})
    write_logs(tmp_path, check_json=report,
               check_log=failed(CHECK_OK, "check", "amp.check: FAILED: 6 passed, 2 failed"))
    check = row(tmp_path, "amp.check")
    assert check.status == summary.NOT_MET
    assert check.result == "7 passed, 2 failed, 0 skipped; failed: multi_tensor_adam on cuda:0, O2 step on cuda:0"


def test_amp_check_skipping_a_gpu_check_is_not_met(tmp_path):
    write_logs(tmp_path, check_json=check_report(**{"multi_tensor_scale@cuda:0": "skip"}))
    check = row(tmp_path, "amp.check")
    assert check.status == summary.NOT_MET and "skipped on the GPU: multi_tensor_scale (skip detail)" in check.result


def test_amp_check_without_its_json_or_its_phase_is_not_run(tmp_path):
    write_logs(tmp_path, check_json=None)
    assert row(tmp_path, "amp.check").status == summary.NOT_RUN
    (tmp_path / "check.log").write_text("gpu_check: phase check not run: the 540 s budget was spent\n")
    check = row(tmp_path, "amp.check")
    assert check.status == summary.NOT_RUN and "budget was spent" in check.result


def test_the_summary_reads_the_json_amp_check_writes(tmp_path):
    # This machine's own report: its format is what the summary parses (no GPU here: not met).
    amp_check.run(devices=["cpu"], quick=True, only=["timing"], json_path=str(tmp_path / "check.json"), quiet=True)
    write_logs(tmp_path, check_json=None)
    check = row(tmp_path, "amp.check")
    assert check.status == summary.NOT_MET and check.result.endswith("no CUDA device was checked")


# ---- a second GPU, eager module loading, the CUDA versions (issue 27 item 7) -------------------------


def test_two_gpus_each_checked_with_the_other_current_is_met(tmp_path):
    write_logs(tmp_path, check_json=check_report(gpus=2))
    second = row(tmp_path, "a second GPU")
    assert second.status == summary.MET and second.result == "4 checks passed on cuda:0, cuda:1"
    _, notes, _ = summary.summarize(tmp_path)
    assert not any("second GPU" in note for note in notes)


def test_a_failure_with_the_other_gpu_current_is_not_met(tmp_path):
    write_logs(tmp_path, check_json=check_report(gpus=2, **{f"O2 step, {summary.OTHER_CURRENT}@cuda:1": "fail"}))
    second = row(tmp_path, "a second GPU")
    assert second.status == summary.NOT_MET
    assert second.result == f"O2 step, {summary.OTHER_CURRENT} on cuda:1: fail (fail detail)"


def test_one_gpu_leaves_the_second_gpu_row_out_with_a_note(tmp_path):
    write_logs(tmp_path)
    rows, notes, markdown = summary.summarize(tmp_path)
    assert not any(r.check.startswith("a second GPU") for r in rows)
    assert "- a second GPU: one GPU was checked, so tensors on cuda:1 with cuda:0 current did not run" in markdown
    assert summary.main(["gpu_check_summary.py", str(tmp_path)]) == 0  # nothing else was missing


def test_the_eager_loading_run_is_a_row_of_its_own(tmp_path):
    write_logs(tmp_path, check_eager_log=failed(CHECK_EAGER_OK, "check_eager", "amp.check: FAILED"),
               check_eager_json=check_report(**{"multi_tensor_scale@cuda:0": "fail"}))
    eager = row(tmp_path, "CUDA_MODULE_LOADING=EAGER")
    assert eager.status == summary.NOT_MET and "failed: multi_tensor_scale on cuda:0" in eager.result
    assert row(tmp_path, "amp.check").status == summary.MET
    write_logs(tmp_path, check_eager_log="gpu_check: phase check_eager not run: the 540 s budget was spent\n",
               check_eager_json=None)
    (tmp_path / "check_eager.json").unlink()
    assert row(tmp_path, "CUDA_MODULE_LOADING=EAGER").status == summary.NOT_RUN


def test_the_summary_names_the_three_cuda_versions(tmp_path):
    write_logs(tmp_path)
    _, _, markdown = summary.summarize(tmp_path)
    assert "CUDA: driver supports 13.1, torch's runtime 13.0, amp_C's static runtime 13.0" in markdown
