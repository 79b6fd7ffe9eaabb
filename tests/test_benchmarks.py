"""The benchmarks run end to end at their smallest settings and print every row they promise.

Timings are never asserted (machines are noisy); these tests only keep the scripts in step with
the API they measure. Each runs as a subprocess from the repository root, like the examples.
"""
import json
import math

import pytest

from amp.multi_tensor_apply import MultiTensorApply
from test_examples import run

pytestmark = pytest.mark.slow

TRAIN_STEP_CONFIGS = ["fp32", "autocast fp16 + GradScaler", "amp O1 (fp16)", "amp O2 (fp16)",
                      "amp O2 + FusedAdam (fp16)", "amp O2 + FusedAdam, model grads",
                      "autocast bf16", "amp O5 (bf16)", "amp O5 + FusedAdam (bf16)",
                      "amp O5 + FusedAdam, model grads", "amp O5 + FusedAdam, remainders"]


def assert_succeeded(result):
    assert result.returncode == 0, f"exit code {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_train_step_benchmark_measures_every_config_of_both_workloads(tmp_path):
    out = tmp_path / "medians.json"
    result = run("benchmarks/train_step.py", "--steps", "1", "--warmup", "0", "--rounds", "1",
                 "--json", str(out))
    assert_succeeded(result)
    medians = json.loads(out.read_text())
    assert sorted(medians["workloads"]) == ["cnn", "gpt"]
    for workload in medians["workloads"].values():
        assert list(workload) == TRAIN_STEP_CONFIGS
        for config in workload.values():
            assert math.isfinite(config["step_ms"]) and config["step_ms"] > 0
            assert math.isfinite(config["overhead_ms"]) and config["overhead_ms"] > 0


def test_unscale_benchmark_prints_the_goals_and_all_three_comparisons():
    result = run("benchmarks/unscale.py", "--reps", "1")
    if not MultiTensorApply.available:
        assert result.returncode == 1 and "Build them first" in result.stderr, result.stderr
        return
    assert_succeeded(result)
    for heading in ("speed-up over (a)", "L2 norm of the fp32 master grads",
                    "master -> model copy, fp32 -> fp16"):
        assert heading in result.stdout, result.stdout


def test_fused_ops_benchmark_prints_a_row_per_form_with_its_fraction_of_a_copy():
    result = run("benchmarks/fused_ops.py", "--reps", "1", "--fallback-reps", "1")
    if not MultiTensorApply.available:
        assert result.returncode == 1 and "Build them first" in result.stderr, result.stderr
        return
    assert_succeeded(result)
    for form in ("sgd: float32 grads", "sgd: float16 grads", "adam: bfloat16 grads"):
        assert form in result.stdout, result.stdout
    assert "of copy" in result.stdout


def test_o1_overhead_benchmark_compares_the_casting_engine_with_autocast_per_model():
    result = run("benchmarks/o1_overhead.py", "--reps", "1", "--iters", "1")
    assert_succeeded(result)
    rows = [line.split() for line in result.stdout.splitlines()]
    models = {row[0] for row in rows if len(row) == 5 and row[0] != "model"}
    assert models == {"transformer", "tiny-xfmr", "cnn"}, result.stdout


def test_remainder_memory_benchmark_prints_held_and_moved_bytes_for_each_setup():
    result = run("benchmarks/remainder_memory.py", "--width", "256", "--layers", "2", "--steps", "2",
                 "--warmup", "0")
    assert_succeeded(result)
    rows = {line[:36].strip(): line[36:].split() for line in result.stdout.splitlines()[2:]}
    assert list(rows) == ["autocast bf16 + AdamW(fused=True)", "amp O5 + FusedAdam, fp32 masters",
                          "amp O5 + FusedAdam, remainders"], result.stdout
    held = {name: float(values[0]) for name, values in rows.items()}
    assert held["amp O5 + FusedAdam, fp32 masters"] == 16.0  # bf16 weight and grad, fp32 master, m, v
    assert held["amp O5 + FusedAdam, fp32 masters"] - held["amp O5 + FusedAdam, remainders"] >= 1.87
