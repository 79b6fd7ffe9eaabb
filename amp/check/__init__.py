"""``python -m amp.check``: the environment report and a self-test of amp's kernels on this machine.

Run it after building ``amp_C`` on a new machine, and paste its output into bug reports::

    python -m amp.check                  # everything, on the CPU and every visible GPU
    python -m amp.check --quick          # fewer cases (under 10 s on a CPU)
    python -m amp.check --json out.json  # also write everything as JSON (fields: docs/reference.md)

or, from a notebook, ``amp.check.run()`` (it prints the same report and returns it).

It prints the versions (amp, torch, the CUDA runtime torch was built with, nvcc, Python), whether
``amp_C`` is built, the GPU code it holds and whether that covers each visible GPU, which code
paths its CPU kernels take on this CPU, and per device which path each op takes (``amp_C`` or
the PyTorch fallback) and why. Then, per device:

* amp's first-use self-test (``amp.check.first_use``: the few cases amp itself runs before it
  trusts ``amp_C`` on a device), then every ``amp_C`` op against the PyTorch fallback
  (``amp.check.kernels``), bit for bit (the l2norm family's norms within
  ``amp.check.kernels.NORM_RTOL``), the overflow flag exactly;
* training steps through amp, O1, O2 and O2 with each fused optimizer, against the PyTorch path
  (``amp.check.training``);
* on each GPU, that amp_C's kernels run on torch's current stream and leave the current device
  alone, and with two GPUs, the first-use self-test and an O2 step on each while the other is
  the current device (``amp.check.gpus``);
* a timing of the fused unscale against PyTorch's (``amp.check.timing``), as a ratio.

A summary table says pass, fail or skip per check and device. A check is skipped where amp does
not use ``amp_C`` (not built, ``AMP_DISABLE_EXTENSION=1``, no CUDA kernels): then the fallback
serves, the training steps still run, and the verdict says that the PyTorch path was verified
and why the kernels were not checked. The kernels and the training steps run ``amp_C`` as built,
whatever amp's first-use self-test decided in this process. Exit status: 0 when nothing failed,
1 when a check failed, 2 for a usage error (argparse's: an unknown flag or device, a JSON file
that cannot be written).

``amp.multi_tensor_apply`` imports ``amp.check.first_use`` when it first tests a device; nothing
else in ``amp`` imports this package.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import IO, List, Optional, Sequence

import torch

from amp import multi_tensor_apply as mta

from . import environment, gpus, kernels, timing, training
from .report import FAIL, KERNELS, PASS, SKIP, Report, Result

__all__ = ["run", "main", "Report", "Result", "PASS", "FAIL", "SKIP", "SECTIONS"]

SECTIONS = ("kernels", "training", "gpus", "timing")


def _check_json_path(path: str) -> None:
    """Refuse before any work a JSON path that cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OSError(f"cannot write the JSON report to {path}: it is a directory")
    if not os.path.isdir(folder):
        raise OSError(f"cannot write the JSON report to {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OSError(f"cannot write the JSON report to {path}: permission denied")


def _devices(names: Optional[Sequence[str]]) -> List[torch.device]:
    if not names:
        return environment.visible_devices()
    devices = []
    for name in names:
        try:
            device = torch.device(name)
        except RuntimeError as err:  # torch's message lists every device type it knows
            raise ValueError(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N") from err
        if device.type == "cpu":
            device = torch.device("cpu")  # one CPU, whatever index was written
        elif device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {name}: PyTorch sees no CUDA device "
                                 f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
            index: Optional[int] = device.index  # None for "cuda" (torch's stubs say int)
            if index is None:
                devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
                continue
            if index >= torch.cuda.device_count():
                count = torch.cuda.device_count()
                raise ValueError(f"--device {name}: only {count} CUDA devices are visible")
        elif device.type != "cpu":
            raise ValueError(f"--device {name}: amp.check knows the CPU and CUDA devices only")
        devices.append(device)
    return list(dict.fromkeys(devices))


def run(devices: Optional[Sequence[str]] = None, quick: bool = False, json_path: Optional[str] = None,
        only: Optional[Sequence[str]] = None, out: Optional[IO[str]] = None, quiet: bool = False) -> Report:
    """Print the report as the checks go, and return it.

    Args:
        devices: device names (``"cpu"``, ``"cuda"``, ``"cuda:1"``); default: the CPU and every
            visible CUDA device.
        quick: fewer cases and repetitions (under 10 s on a CPU).
        json_path: also write the report there as JSON (docs/reference.md lists the fields); checked
            before anything runs.
        only: a subset of ``SECTIONS``; the environment report is always made.
        out: where to print (default: ``sys.stdout``); ``quiet=True`` prints nothing.

    ``report.passed`` is False when a check failed.
    """
    start = time.perf_counter()
    sections = list(only) if only else list(SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if json_path is not None:
        _check_json_path(json_path)
    targets = _devices(devices)
    stream = None if quiet else (out or sys.stdout)

    def say(line: str) -> None:
        if stream is not None:
            print(line, file=stream, flush=True)

    say(f"amp.check{' --quick' if quick else ''}: environment")
    report = Report(environment.collect(targets), quick)
    for line in environment.describe(report.environment):
        say(line)
    # amp.check tests every kernel itself, and its training steps must run the kernels as built:
    # amp's first-use self-test would put a wrong one aside before they could catch it.
    with mta.use_self_test(False):
        if "kernels" in sections:
            say("amp.check: amp_C kernels against the PyTorch fallback")
            for device in targets:
                tests = itertools.chain([kernels.first_use_test(device)],
                                        (kernels.self_test(op, device, quick) for op in environment.OPS))
                report.add_all(tests, stream, KERNELS)
        if "training" in sections:
            say("amp.check: training steps, amp's path against PyTorch's")
            for device in targets:
                for name in training.checks(quick):
                    report.add(training.training_check(name, device), stream, "training steps")
        if "gpus" in sections:
            say("amp.check: the GPU's current stream and device, and a second GPU")
            gpu_targets = [device for device in targets if device.type == "cuda"]
            if not gpu_targets:
                say("  (no GPU is being checked)")
            for device in gpu_targets:
                report.add_all(gpus.checks(device, gpu_targets), stream, "gpus")
        if "timing" in sections:
            say("amp.check: fused unscale against PyTorch's")
            for device in targets:
                report.add(timing.unscale_timing(device, quick), stream, "timing")
    report.seconds = time.perf_counter() - start
    say("amp.check: summary")
    say(report.summary())
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(report.to_json(), f, indent=2)
            f.write("\n")
        say(f"amp.check: wrote {json_path}")
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m amp.check",
        description="amp's environment report and kernel self-test; paste its output into bug reports.",
        epilog="Exit status: 0 nothing failed, 1 a check failed, 2 usage error or unwritable --json file.")
    parser.add_argument("--quick", action="store_true", help="fewer cases (under 10 s on a CPU)")
    parser.add_argument("--json", metavar="FILE", help="also write the report to FILE as JSON")
    parser.add_argument("--device", action="append", metavar="DEVICE",
                        help="check only this device (cpu, cuda, cuda:N); repeatable; default: all")
    parser.add_argument("--only", action="append", choices=SECTIONS,
                        help="run only this section (the environment is always reported); repeatable")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        report = run(devices=args.device, quick=args.quick, json_path=args.json, only=args.only)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    return 0 if report.passed else 1
