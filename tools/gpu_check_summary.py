"""Turns the logs that ``tools/gpu_check.sh`` leaves in its output folder into ``summary.md``.

One row per figure the GPU check exists to produce (issues 12, 20 and 27), each marked met, not met or
not run, with the reason; with one GPU, the second-GPU row is left out and a note says so. The parsing lives here rather than in the shell script so that it can be
tested on a machine without a GPU, from small synthetic logs.

    python tools/gpu_check_summary.py OUT_DIR    # prints the table; exit 0 only if every row is met

Each phase of the script appends one line to its log, ``gpu_check: phase NAME exit RC after S s``
or ``gpu_check: phase NAME not run: REASON``; test files left out for a missing package are
named by lines ``gpu_check: not run: REASON``.
"""
import json
import re
import sys
from collections import namedtuple
from pathlib import Path

# The goals, from issue 12.
UNSCALE_VS_TORCH_GOAL = 1.5  # amp_C's speed over copy_ + _amp_foreach_non_finite_check_and_unscale_
UNSCALE_VS_COPY_GOAL = 0.85  # amp_C's speed as a fraction of a plain fp16 -> fp32 copy's
FUSED_VS_COPY_GOAL = 0.8  # each fused optimizer kernel's speed as a fraction of a copy of its bytes
O2_VS_TORCH_GOAL = 1.0  # O2's step time and peak memory over autocast + GradScaler's

SYNC_FREE_TEST = "tests/test_sync_free.py::test_cuda_fused_step_has_no_sync"
TORCH_FP16, AMP_O2 = "autocast fp16 + GradScaler", "amp O2 (fp16)"
# O5 with bf16 remainders against torch's bf16 recipe: post-backward time and peak memory (goal <= 1.0).
TORCH_BF16, AMP_O5_REMAINDERS = "autocast bf16", "amp O5 + FusedAdam, remainders"
# (amp's row, torch's row, label, [(what, JSON key, unit)]) that train_step_rows compares.
TRAIN_STEP_COMPARISONS = [
    (AMP_O2, TORCH_FP16, "O2", [("step time", "step_ms", "ms"), ("peak memory", "peak_mib", "MiB")]),
    (AMP_O5_REMAINDERS, TORCH_BF16, "O5 remainders",
     [("post-backward time", "overhead_ms", "ms"), ("peak memory", "peak_mib", "MiB")]),
]
OTHER_CURRENT = "with the other GPU current"  # how amp.check.gpus names its checks of a second GPU
TIMED_OUT = (124, 137)  # timeout(1)'s codes: the limit's signal, then KILL

MET, NOT_MET, NOT_RUN = "met", "not met", "not run"
Row = namedtuple("Row", "check result goal status")

PHASE = re.compile(r"^gpu_check: phase (\S+) (?:exit (\d+) after (\d+) s|not run: (.*))$", re.M)
LEFT_OUT = re.compile(r"^gpu_check: not run: (.*)$", re.M)
DEVICE = re.compile(r"^gpu_check: device (.*)$", re.M)
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
PYTEST_TOTAL = re.compile(r"\bin \d+(\.\d+)?s\b|no tests ran")
SPEEDUP = re.compile(r"speed-up over \(a\):\s*([0-9.]+)x")
COPY_FRACTION = re.compile(r"fraction of the copy limit \(b\):\s*([0-9.]+)")
# A row of benchmarks/fused_ops.py: form, bytes per param, kernel ms, copy ms, fraction of the copy.
FUSED_ROW = re.compile(r"^((?:sgd|adam|lamb): .*?)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s", re.M)


def read(out_dir, name):
    path = Path(out_dir, name)
    return path.read_text(errors="replace") if path.exists() else ""


def phase_outcome(log, name):
    """(MET, None) when phase ``name`` exited with 0; else (NOT_MET or NOT_RUN, why)."""
    output_start = 0  # a phase's output runs from the previous phase's record to its own
    for match in PHASE.finditer(log):
        output, output_start = log[output_start:match.start()], match.end()
        if match.group(1) != name:
            continue
        if match.group(4) is not None:
            return NOT_RUN, f"not run: {match.group(4)}"
        code, seconds = int(match.group(2)), match.group(3)
        if code == 0:
            return MET, None
        if code in TIMED_OUT:
            return NOT_MET, f"timed out after {seconds} s"
        return NOT_MET, f"exit {code} after {seconds} s: {last_output_line(output)}"
    return NOT_RUN, f"no record of phase {name} (the script stopped early?)"


def last_output_line(output):
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("gpu_check:")]
    return lines[-1].strip()[:200] if lines else "no output"


def pytest_counts(log):
    """{'passed': n, ...} from pytest's last summary line, or None when it printed none."""
    for line in reversed(log.splitlines()):
        if PYTEST_TOTAL.search(line):
            counts = {word.rstrip("s") if word.startswith("error") else word: int(n)
                      for n, word in PYTEST_COUNT.findall(line)}
            return {key: counts.get(key, 0) for key in ("passed", "failed", "error", "skipped")}
    return None


def tests_row(check, log, phase):
    status, problem = phase_outcome(log, phase)
    counts = pytest_counts(log) if status != NOT_RUN else None
    goal = "all pass"
    if counts is None:
        return Row(check, problem or "pytest printed no summary line", goal, NOT_RUN)
    result = ", ".join(f"{n} {word}" for word, n in counts.items())
    broken = counts["failed"] + counts["error"]
    if status == MET and broken == 0 and counts["passed"] > 0:
        return Row(check, result, goal, MET)
    return Row(check, result + (f" ({problem})" if problem else ""), goal, NOT_MET)


def build_row(log):
    check, goal = "amp_C built for this GPU", "builds; amp_C.cuda_available()"
    for phase in ("build", "amp_C"):
        status, problem = phase_outcome(log, phase)
        if status != MET:
            return Row(check, problem, goal, status)
    return Row(check, "built, CUDA kernels available", goal, MET)


def check_row(log, report_text, phase="check",
              check="amp.check: every amp_C op, training step, stream check and timing on the GPU"):
    """``python -m amp.check`` (check.json): met when nothing failed and every check on the GPU ran."""
    goal = "passes, none skipped on the GPU"
    status, problem = phase_outcome(log, phase)
    if status == NOT_RUN or not report_text:
        return Row(check, problem or "no check.json", goal, NOT_RUN)
    try:
        results = [(r["check"], r["device"], r["status"], r["detail"], r["ratio"])
                   for r in json.loads(report_text)["results"]]
    except (ValueError, KeyError, TypeError) as err:
        return Row(check, f"check.json is not what this summary reads: {err!r}", goal, NOT_RUN)
    counts = {word: sum(r[2] == word for r in results) for word in ("pass", "fail", "skip")}
    result = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
    on_gpu = [r for r in results if r[1].startswith("cuda")]
    ratios = [f"unscale {r[4]:.2f}x PyTorch's on {r[1]}" for r in on_gpu if r[4] is not None]
    failed = [f"{r[0]} on {r[1]}" for r in results if r[2] == "fail"]
    skipped = [r for r in on_gpu if r[2] == "skip"]
    if failed:
        return Row(check, f"{result}; failed: {', '.join(failed)}", goal, NOT_MET)
    if not on_gpu:
        return Row(check, f"{result}; no CUDA device was checked", goal, NOT_MET)
    if skipped:
        return Row(check, f"{result}; skipped on the GPU: {skipped[0][0]} ({skipped[0][3]})", goal, NOT_MET)
    if status != MET:
        return Row(check, f"{result} ({problem})", goal, NOT_MET)
    return Row(check, "; ".join([result, *ratios]), goal, MET)


def second_gpu_row(report_text):
    """The checks of ``amp.check.gpus`` with the other GPU current (check.json), or None where fewer
    than two GPUs were checked (a note says so)."""
    check = "a second GPU: the first-use self-test and an O2 step on cuda:1 with cuda:0 current, and the reverse"
    goal = "passes on both GPUs"
    if not report_text:
        return Row(check, "no check.json", goal, NOT_RUN)
    try:
        document = json.loads(report_text)
        gpus = [d["device"] for d in document["devices"] if d["device"].startswith("cuda")]
        results = [(r["check"], r["device"], r["status"], r["detail"]) for r in document["results"]
                   if r["check"].endswith(OTHER_CURRENT)]
    except (ValueError, KeyError, TypeError) as err:
        return Row(check, f"check.json is not what this summary reads: {err!r}", goal, NOT_RUN)
    if len(gpus) < 2:
        return None
    devices = sorted({r[1] for r in results if r[2] == "pass"})
    bad = [f"{r[0]} on {r[1]}: {r[2]} ({r[3]})" for r in results if r[2] != "pass"]
    if bad or len(devices) < 2:
        return Row(check, "; ".join(bad) or f"passed on {', '.join(devices) or 'no GPU'} only", goal, NOT_MET)
    return Row(check, f"{len(results)} checks passed on {', '.join(devices)}", goal, MET)


def cuda_versions(report_text):
    """The CUDA versions check.json reports, in a line: amp_C's runtime is its own (static)."""
    try:
        document = json.loads(report_text)
        driver, torch_cuda = document["versions"]["cuda_driver"], document["versions"]["torch_cuda"]
        amp_runtime = document["amp_C"]["cuda_runtime"]
    except (ValueError, KeyError, TypeError):
        return None
    return f"driver supports {driver}, torch's runtime {torch_cuda}, amp_C's static runtime {amp_runtime}"


def sync_free_row(log):
    check = f"no host sync under set_sync_debug_mode('error') ({SYNC_FREE_TEST})"
    outcomes = re.findall(rf"^(PASSED|FAILED|ERROR) {re.escape(SYNC_FREE_TEST)}\b", log, re.M)
    if not outcomes:
        problem = phase_outcome(log, "cuda_tests")[1]
        return Row(check, problem or "the test did not run (skipped or not collected)", "passes", NOT_RUN)
    passed = outcomes.count("PASSED")
    status = MET if passed == len(outcomes) else NOT_MET
    return Row(check, f"{passed} of {len(outcomes)} cases passed", "passes", status)


def unscale_rows(log):
    checks = (("unscale: amp_C vs copy_ + _amp_foreach_non_finite_check_and_unscale_", SPEEDUP,
               UNSCALE_VS_TORCH_GOAL, "x faster"),
              ("unscale: amp_C vs a plain fp16 -> fp32 copy", COPY_FRACTION,
               UNSCALE_VS_COPY_GOAL, " of its speed"))
    # The ratios are printed first: a later failure of the script leaves them valid.
    problem = phase_outcome(log, "unscale")[1]
    rows = []
    for check, pattern, goal, unit in checks:
        match = pattern.search(log)
        if match is None:
            reason = problem or "no ratio in the log (did benchmarks/unscale.py change its output?)"
            rows.append(Row(check, reason, f">= {goal}", NOT_RUN))
            continue
        value = float(match.group(1))
        result = f"{value:.2f}{unit}" + (f" (then {problem})" if problem else "")
        rows.append(Row(check, result, f">= {goal}", MET if value >= goal else NOT_MET))
    return rows


def fused_ops_rows(log):
    status, problem = phase_outcome(log, "fused_ops")
    rows = []
    for form, nbytes, _, _, fraction in FUSED_ROW.findall(log):
        value = float(fraction)
        rows.append(Row(f"fused {form} ({nbytes} B/param) vs a copy of its bytes",
                        f"{value:.2f} of its speed", f">= {FUSED_VS_COPY_GOAL}",
                        MET if value >= FUSED_VS_COPY_GOAL else NOT_MET))
    if not rows:
        reason = problem or "no rows in the log (did benchmarks/fused_ops.py change its output?)"
        rows.append(Row("fused optimizer kernels vs a copy of their bytes", reason,
                        f">= {FUSED_VS_COPY_GOAL}", NOT_RUN))
    return rows


def train_step_rows(log, report_text):
    check, goal = "train_step: amp O2 vs autocast + GradScaler", f"<= {O2_VS_TORCH_GOAL}"
    status, problem = phase_outcome(log, "train_step")
    if status != MET or not report_text:
        return [Row(check, problem or "no train_step.json", goal, NOT_RUN)]
    try:
        tables = json.loads(report_text)["workloads"]
        missing = [name for table in tables.values() for name in (AMP_O2, TORCH_FP16) if name not in table]
        if missing:  # the O2 rows are what this summary was written for; the others may be absent
            raise KeyError(missing[0])
    except (ValueError, KeyError) as err:
        return [Row(check, f"train_step.json is not what this summary reads: {err!r}", goal, NOT_RUN)]
    rows = []
    for workload, table in tables.items():
        for amp_row, torch_row, label, measures in TRAIN_STEP_COMPARISONS:
            for what, key, unit in measures:
                check = f"train_step {workload}: {label} {what} vs {torch_row}"
                ours, theirs = table.get(amp_row), table.get(torch_row)
                if ours is None or theirs is None:
                    rows.append(Row(check, f"no {amp_row!r} row in train_step.json", goal, NOT_RUN))
                elif ours[key] is None or theirs[key] is None:
                    rows.append(Row(check, f"{what} was not measured (CUDA only)", goal, NOT_RUN))
                else:
                    ratio = ours[key] / theirs[key]
                    result = f"{ratio:.2f}x ({ours[key]:.2f} {unit} vs {theirs[key]:.2f} {unit})"
                    rows.append(Row(check, result, goal, MET if ratio <= O2_VS_TORCH_GOAL else NOT_MET))
    return rows


def summarize(out_dir):
    """(rows, notes, markdown) for the logs in ``out_dir``."""
    logs = {name: read(out_dir, f"{name}.log")
            for name in ("build", "check", "check_eager", "cuda_tests", "cpu_suite", "unscale", "fused_ops",
                         "train_step")}
    report = read(out_dir, "check.json")
    second_gpu = second_gpu_row(report)
    rows = [build_row(logs["build"]),
            check_row(logs["check"], report),
            *([second_gpu] if second_gpu is not None else []),
            check_row(logs["check_eager"], read(out_dir, "check_eager.json"), "check_eager",
                      "CUDA_MODULE_LOADING=EAGER: amp.check's kernels and GPU checks"),
            tests_row("CUDA tests (pytest -m cuda)", logs["cuda_tests"], "cuda_tests"),
            sync_free_row(logs["cuda_tests"]),
            tests_row("CPU suite against amp_C (pytest -m 'not cuda')", logs["cpu_suite"], "cpu_suite"),
            *unscale_rows(logs["unscale"]),
            *fused_ops_rows(logs["fused_ops"]),
            *train_step_rows(logs["train_step"], read(out_dir, "train_step.json"))]
    notes = sorted({note for log in logs.values() for note in LEFT_OUT.findall(log)})
    if second_gpu is None:
        notes.append("a second GPU: one GPU was checked, so tensors on cuda:1 with cuda:0 current did not run")
    device = DEVICE.search(logs["build"])
    versions = cuda_versions(report)
    lines = ["# GPU check", "", f"Device: {device.group(1) if device else 'unknown'}", "",
             *([f"CUDA: {versions}", ""] if versions else []),
             "| check | result | goal | status |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.check} | {r.result} | {r.goal} | {r.status} |" for r in rows]
    if notes:
        lines += ["", "Left out:"] + [f"- {note}" for note in notes]
    return rows, notes, "\n".join(lines) + "\n"


def main(argv):
    if len(argv) != 2:
        raise SystemExit("usage: python tools/gpu_check_summary.py OUT_DIR (the folder gpu_check.sh wrote)")
    rows, _, markdown = summarize(argv[1])
    Path(argv[1], "summary.md").write_text(markdown)
    print(markdown, end="")
    return 0 if all(row.status == MET for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
