"""``python -m amp.check`` passes on this machine with and without amp_C, fails naming the op and
device when a kernel is wrong, and writes the JSON fields docs/reference.md lists.

A wrong kernel is made on purpose: a stand-in ``amp_C`` whose ops are the PyTorch fallback's,
one of them wrapped to flip one output bit, ignore the flag, or raise.
"""
import io
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import amp
import amp.check
import amp.multi_tensor_apply as mta
from amp import _pytorch_ops as _torch_ops
from amp._amp_state import _amp_state
from amp.check import environment, gpus, kernels, training
from amp.check.report import FAIL, PASS, SKIP, Report, Result
from amp.multi_tensor_apply import use_extension
from amp_common import flip_one_bit, ignore_the_flag, stand_in_amp_C

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def command(tmp_path, *args, **env):
    """``python -m amp.check --quick --json F *args`` in a fresh process: (exit status, output, JSON)."""
    report = tmp_path / "check.json"
    environ = dict(os.environ, PYTHONPATH=str(REPO), **env)
    result = subprocess.run([sys.executable, "-m", "amp.check", "--quick", "--json", str(report), *args],
                            cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    document = json.loads(report.read_text()) if report.exists() else None
    return result.returncode, result.stdout + result.stderr, document


def fields(value, prefix=""):
    """The dotted paths of a JSON document's leaves; ``a[].b`` for a list of objects."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from fields(item, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        for item in value:
            yield from fields(item, prefix + "[]")
    else:
        yield prefix


def documented_fields():
    """The fields the "Check your installation" table of docs/reference.md lists."""
    reference = (REPO / "docs" / "reference.md").read_text()
    section = reference.split("## Check your installation", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


# ---- the command on this machine ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, {"AMP_DISABLE_EXTENSION": "1"}], ids=["as-built", "no-extension"])
def test_the_quick_command_passes_and_writes_the_readme_s_fields(tmp_path, monkeypatch, env):
    status, output, document = command(tmp_path, **env)
    assert status == 0, output
    assert document is not None and document["passed"] is True and document["quick"] is True
    assert set(fields(document)) == documented_fields()
    assert "amp.check: PASSED" in output and "check.json" in output
    results = {(r["check"], r["device"]): r for r in document["results"]}
    for key, value in env.items():  # this process as the command's saw it
        monkeypatch.setenv(key, value)
    with use_extension(not env):
        expected = [(op, mta.path_for(op, CPU)) for op in environment.OPS]
    for op, (path, reason) in expected:
        # The ops the fallback serves are skipped with its reason; amp_C's must pass.
        assert results[op, "cpu"]["status"] == (PASS if path == "amp_C" else SKIP), op
        if path != "amp_C":
            detail = results[op, "cpu"]["detail"]
            assert (reason in detail) if mta.amp_C is not None else detail == "amp_C is not built"
    assert results["first-use self-test", "cpu"]["status"] == expected[0][1][0].replace("amp_C", PASS).replace(
        "torch", SKIP)
    if env:
        assert all(op["path"] == "torch" and op["reason"] == "switched off by AMP_DISABLE_EXTENSION=1"
                   for op in document["devices"][0]["ops"])
    for name in training.checks(quick=True):
        assert results[name, "cpu"]["status"] == PASS, results[name, "cpu"]
    versions = document["versions"]
    assert versions["torch"] == torch.__version__ and versions["amp"] == amp.__version__
    assert versions["torch_cuda"] == torch.version.cuda


def test_the_readme_table_names_every_field_once():
    assert {"passed", "amp_C.cuda_images", "devices[].ops[].reason", "results[].status"} <= documented_fields()


def test_an_unknown_flag_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        amp.check.main(["--frobnicate"])
    assert exit_info.value.code == 2
    assert "usage: python -m amp.check" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_a_json_file_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys, where):
    path = tmp_path / "no" / "such" / "check.json" if where == "missing-folder" else tmp_path
    with pytest.raises(SystemExit) as exit_info:
        amp.check.main(["--quick", "--json", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    assert f"cannot write the JSON report to {path}" in err.err and "usage:" in err.err
    assert "amp.check" not in err.out  # nothing ran


def test_a_device_that_is_not_there_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        amp.check.main(["--device", "cuda:99"])
    assert exit_info.value.code == 2 and "--device cuda:99" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bogus", "cuda:abc", "", "CPU", "meta"])
def test_a_device_name_amp_check_cannot_use_is_one_usage_error_line(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        amp.check.main(["--quick", "--device", name])
    err = capsys.readouterr()
    errors = [line for line in err.err.splitlines() if not line.startswith(("usage:", " "))]
    assert exit_info.value.code == 2 and len(errors) == 1, err.err
    assert errors[0].startswith(f"python -m amp.check: error: --device {name!r}"[:40]) or "--device" in errors[0]
    assert "Traceback" not in err.err and "amp.check" not in err.out  # nothing ran


def test_every_spelling_of_the_cpu_is_checked_once():
    assert amp.check._devices(["cpu", "cpu:0", "cpu:1"]) == [CPU]


# ---- a wrong kernel ---------------------------------------------------------------------------------


@pytest.fixture
def kernels_with(monkeypatch):
    """``install(op=wrong)``: amp_C, for the rest of the test, is the fallback with ``wrong`` for op."""
    def install(**wrong):
        monkeypatch.setattr(mta, "amp_C", stand_in_amp_C(**wrong))
    with use_extension(True):
        yield install


@pytest.mark.parametrize("op, wrong", [
    ("multi_tensor_scale", flip_one_bit(_torch_ops.multi_tensor_scale)),
    ("multi_tensor_axpby", flip_one_bit(_torch_ops.multi_tensor_axpby)),
    ("multi_tensor_sgd", flip_one_bit(_torch_ops.multi_tensor_sgd, index=1)),
    ("multi_tensor_adam", flip_one_bit(_torch_ops.multi_tensor_adam, index=3)),
    ("multi_tensor_lamb", flip_one_bit(_torch_ops.multi_tensor_lamb, index=1)),
    ("update_scale_hysteresis", flip_one_bit(_torch_ops.update_scale_hysteresis, argument=0, index=None)),
    ("multi_tensor_scale", ignore_the_flag(_torch_ops.multi_tensor_scale)),
    ("multi_tensor_axpby", ignore_the_flag(_torch_ops.multi_tensor_axpby)),
    ("multi_tensor_l2norm", ignore_the_flag(_torch_ops.multi_tensor_l2norm)),
    ("multi_tensor_l2norm_mp", ignore_the_flag(_torch_ops.multi_tensor_l2norm_mp)),
    ("multi_tensor_sgd", ignore_the_flag(_torch_ops.multi_tensor_sgd)),
    ("multi_tensor_adam", ignore_the_flag(_torch_ops.multi_tensor_adam)),
    ("multi_tensor_lamb", ignore_the_flag(_torch_ops.multi_tensor_lamb)),
], ids=lambda v: v if isinstance(v, str) else v.__qualname__.split(".")[0])
def test_a_wrong_kernel_fails_its_self_test(kernels_with, op, wrong):
    kernels_with()
    assert kernels.self_test(op, CPU, quick=True).status == PASS  # the stand-in alone is right
    kernels_with(**{op: wrong})
    result = kernels.self_test(op, CPU, quick=True)
    assert (result.check, result.device, result.status) == (op, "cpu", FAIL)
    assert "with amp_C but" in result.detail and "with the fallback" in result.detail


def test_a_flipped_bit_is_named_with_both_values(kernels_with):
    kernels_with(multi_tensor_scale=flip_one_bit(_torch_ops.multi_tensor_scale))
    detail = kernels.self_test("multi_tensor_scale", CPU, quick=True).detail
    # e.g. "float32 -> float32, 9 tensors: tensor_lists[1][4][8] is 0.0123 (0x3c49...) with amp_C but ..."
    assert re.search(r"tensor_lists\[1\]\[\d+\]\[\d+\] is \S+ \(0x[0-9a-f]+\) with amp_C but \S+ "
                     r"\(0x[0-9a-f]+\) with the fallback", detail), detail


@pytest.mark.parametrize("relative, status", [(kernels.NORM_RTOL / 10, PASS), (kernels.NORM_RTOL * 10, FAIL)])
def test_norms_are_held_to_the_documented_tolerance(kernels_with, relative, status):
    def off(*args):
        total, per_tensor = _torch_ops.multi_tensor_l2norm(*args)
        return total * (1 + relative), per_tensor
    kernels_with(multi_tensor_l2norm=off)
    assert kernels.self_test("multi_tensor_l2norm", CPU, quick=True).status == status


def test_a_kernel_that_raises_fails_with_its_error(kernels_with):
    def broken(*args):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
    kernels_with(multi_tensor_adam=broken)
    result = kernels.self_test("multi_tensor_adam", CPU, quick=True)
    assert result.status == FAIL and "amp_C raised RuntimeError: CUDA error: no kernel image" in result.detail


def test_the_command_exits_1_and_names_the_wrong_op_and_device(kernels_with, capsys):
    kernels_with(multi_tensor_axpby=ignore_the_flag(_torch_ops.multi_tensor_axpby))
    assert amp.check.main(["--quick", "--only", "kernels", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "[fail] multi_tensor_axpby on cpu" in out
    assert re.search(r"^  multi_tensor_axpby\s+fail\s*$", out, re.M)
    assert re.search(r"^  multi_tensor_scale\s+pass\s*$", out, re.M)
    # amp's own first-use self-test, which amp.check shows too, finds it as well.
    assert re.search(r"\[fail\] first-use self-test on cpu: \d+ cases, multi_tensor_axpby: .* with amp_C but", out)
    assert "amp.check: FAILED: 8 passed, 2 failed" in out
    assert "  failed: multi_tensor_axpby on cpu: " in out


def test_a_wrong_unscale_kernel_also_fails_the_training_steps(kernels_with):
    # A mantissa bit that matters: the lowest one of a gradient can round away in the update.
    kernels_with(multi_tensor_scale=flip_one_bit(_torch_ops.multi_tensor_scale, bit=20))
    report = amp.check.run(devices=["cpu"], quick=True, only=["training"], quiet=True)
    statuses = {result.check: result.status for result in report.results}
    assert statuses["O1 step"] == statuses["O2 step"] == FAIL and not report.passed
    assert "between amp's path and PyTorch's" in report.failures[0].detail


def test_a_kernel_s_fault_reaches_the_json(kernels_with, tmp_path):
    kernels_with(update_scale_hysteresis=flip_one_bit(_torch_ops.update_scale_hysteresis, argument=0, index=None))
    report = amp.check.run(devices=["cpu"], quick=True, only=["kernels"], json_path=str(tmp_path / "c.json"),
                           quiet=True)
    document = json.loads((tmp_path / "c.json").read_text())
    assert document["passed"] is False is report.passed
    failed = [(r["check"], r["device"]) for r in document["results"] if r["status"] == FAIL]
    assert failed == [("first-use self-test", "cpu"), ("update_scale_hysteresis", "cpu")]


# ---- the environment report -------------------------------------------------------------------------


@pytest.mark.parametrize("images, capability, covered", [
    (["sm_80"], (8, 0), True), (["sm_80"], (8, 6), True), (["sm_80"], (9, 0), False),
    (["sm_86"], (8, 0), False), (["sm_80", "compute_80"], (9, 0), True), (["compute_90"], (8, 9), False),
    (["sm_90a"], (9, 0), True), (["sm_90a"], (10, 0), False), (["compute_90a"], (10, 0), False),
    (["sm_100f"], (10, 3), True), (["sm_100", "sm_120"], (12, 0), True), ([], (9, 0), False),
    (None, (9, 0), None),
])
def test_gpu_code_covers_a_gpu_by_cuda_s_compatibility_rules(images, capability, covered):
    assert mta.covers(images, capability) is covered


def test_a_gpu_the_build_has_no_code_for_takes_the_pytorch_path_with_how_to_rebuild(monkeypatch):
    fake = types.SimpleNamespace(cuda_available=lambda: True, **{
        "build_info": lambda: {"cuda_kernels": True, "torch_cuda": True, "cuda_images": ["sm_80", "sm_90"],
                               "cpu_x86_64_v3_clones": True, "cpu_runs_x86_64_v3": False, "cpu_f16c_stores": True},
        **{name: getattr(_torch_ops, name) for name in _torch_ops.__all__}})
    monkeypatch.setattr(mta, "amp_C", fake)
    monkeypatch.setattr(mta, "_extension_cuda", True)
    monkeypatch.setattr(mta, "_missing_gpu_code", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A future GPU")
    with use_extension(True):
        env = environment.collect([CPU, torch.device("cuda", 0)])
    gpu = env["devices"][1]
    assert (gpu["device"], gpu["capability"], gpu["amp_C_covers"]) == ("cuda:0", "12.0", False)
    # Such a GPU takes the PyTorch path (a kernel launch would fail there), and the report says why.
    assert all(op["path"] == "torch" and 'TORCH_CUDA_ARCH_LIST="8.0;9.0;12.0+PTX"' in op["reason"]
               for op in gpu["ops"])
    assert mta._implementation("multi_tensor_scale", torch.device("cuda", 0)) is _torch_ops.multi_tensor_scale
    assert env["cpu"]["amp_C_path"].startswith("loops: baseline x86-64 clones")
    lines = "\n".join(environment.describe(env))
    assert "cuda:0: A future GPU (capability 12.0); amp_C code for it: NOT covered" in lines
    assert "images: sm_80, sm_90" in lines


def test_the_report_says_why_amp_C_is_not_used(monkeypatch):
    monkeypatch.setattr(mta, "amp_C", None)
    with use_extension(True):
        env = environment.collect([CPU])
    assert env["amp_C"]["built"] is False and env["cpu"]["amp_C_path"] == "none (amp_C is not built)"
    assert {op["path"] for op in env["devices"][0]["ops"]} == {"torch"}
    assert "not available" in env["devices"][0]["ops"][0]["reason"]
    with use_extension(True):
        result = kernels.self_test("multi_tensor_scale", CPU, quick=True)
    assert result.status == SKIP and result.detail == "amp_C is not built"


def test_without_amp_C_the_reason_is_said_once_and_the_pytorch_path_is_verified(monkeypatch):
    monkeypatch.setattr(mta, "amp_C", None)
    monkeypatch.setattr(mta, "_import_error", ImportError("No module named 'amp_C'"))
    monkeypatch.setattr(mta.MultiTensorApply, "import_err", mta._import_error)
    out = io.StringIO()
    with use_extension(True):
        report = amp.check.run(devices=["cpu"], quick=True, only=["kernels", "timing"], out=out)
    text = out.getvalue()
    assert report.passed and text.count("No module named 'amp_C'") == 1
    assert text.count(mta._BUILD_HINT) == 1
    assert [line for line in text.splitlines() if "[skip]" in line] == [
        "  [skip] 10 checks (first-use self-test ... multi_tensor_lamb) on cpu: amp_C is not built",
        "  [skip] unscale timing on cpu: for the reason above"]
    assert re.search(r"^  amp_C kernels \(10 checks\)\s+skip\s*$", text, re.M)
    assert text.splitlines()[-1].startswith("amp.check: PASSED: the PyTorch path is verified (")
    assert text.splitlines()[-1].endswith("amp_C's kernels were not checked (amp_C is not built)")


# ---- training steps and amp's state --------------------------------------------------------------


def test_the_training_steps_leave_no_amp_state_behind():
    matmul = torch.matmul
    result = training.training_check("O1 step", CPU)
    assert result.status == PASS, result.detail
    assert _amp_state.context is None and _amp_state.handle is None and _amp_state.runs == []
    assert torch.matmul is matmul  # O1's patches are gone


def test_the_training_steps_do_not_disturb_a_process_s_amp_runs():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    context = _amp_state.context
    result = training.training_check("O2 step", CPU)
    assert result.status == SKIP and "python -m amp.check" in result.detail
    assert _amp_state.context is context


def test_the_summary_has_a_column_per_device():
    report = Report({}, quick=True, results=[
        Result("multi_tensor_scale", "cpu", PASS, "ok"), Result("multi_tensor_scale", "cuda:0", FAIL, "bits"),
        Result("unscale timing", "cpu", PASS, "t", ratio=1.5), Result("unscale timing", "cuda:0", SKIP, "no")])
    table = report.summary()
    assert re.search(r"^  check\s+cpu\s+cuda:0\s*$", table, re.M)
    assert re.search(r"^  multi_tensor_scale\s+pass\s+fail\s*$", table, re.M)
    assert re.search(r"^  unscale timing\s+pass 1.50x\s+skip\s*$", table, re.M)
    assert "FAILED: 2 passed, 1 failed, 1 skipped" in table and "failed: multi_tensor_scale on cuda:0: bits" in table


# ---- the GPU's current stream and a second GPU ------------------------------------------------------


def test_the_gpu_checks_make_no_rows_for_the_cpu():
    assert gpus.checks(CPU, []) == []


@pytest.mark.parametrize("index, other", [(0, 1), (1, 0), (2, None)])
def test_the_first_two_gpus_are_each_checked_with_the_other_current(index, other):
    devices = [torch.device("cuda", i) for i in range(3)]
    assert gpus._other(devices[index], devices) == (None if other is None else devices[other])


def test_where_amp_C_does_not_serve_a_gpu_its_checks_are_skipped_by_name(kernels_with, monkeypatch):
    kernels_with()
    monkeypatch.setattr(mta, "_extension_cuda", False)
    results = gpus.checks(torch.device("cuda", 1), [torch.device("cuda", 0), torch.device("cuda", 1)])
    assert [(r.check, r.device, r.status) for r in results] == [
        ("current stream", "cuda:1", SKIP), (f"first-use self-test, {gpus.OTHER_CURRENT}", "cuda:1", SKIP),
        (f"O2 step, {gpus.OTHER_CURRENT}", "cuda:1", SKIP)]
    assert all(r.detail == "amp runs the PyTorch fallback here (amp_C was built without CUDA kernels)"
               for r in results)


@pytest.mark.cuda
def test_the_gpu_checks_pass_on_this_machine():
    report = amp.check.run(quick=True, only=["gpus"], quiet=True)
    assert report.passed, report.summary()
    checks = {(r.check, r.device) for r in report.results if r.status == PASS}
    count = torch.cuda.device_count()
    assert {("current stream", f"cuda:{i}") for i in range(count)} <= checks
    if count > 1:
        assert {(f"O2 step, {gpus.OTHER_CURRENT}", f"cuda:{i}") for i in (0, 1)} <= checks


@pytest.mark.parametrize("driver, amp_runtime, says", [
    ("13.0", "13.0", None),
    ("13.0", "13.2", "it runs by CUDA's minor version compatibility, but this driver cannot JIT-compile its PTX"),
    ("12.8", "13.0", "its kernels cannot run here"),
])
def test_the_report_sets_amp_C_s_runtime_beside_the_driver_s(driver, amp_runtime, says):
    lines = environment._cuda_lines("13.0", driver, amp_runtime)
    assert lines[0] == (f"  CUDA: driver supports {driver}; torch's runtime 13.0; amp_C's runtime {amp_runtime} "
                        "(linked in statically)")
    assert (len(lines) == 1) if says is None else (says in lines[1] and f"CUDA {driver} toolkit" in lines[1])
    assert environment._cuda_lines(None, None, None) == []
