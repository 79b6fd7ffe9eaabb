"""The results of ``python -m amp.check``: one record per check and device, the summary table,
and the JSON document (its fields are listed in docs/reference.md, "Check your installation").

A record is ``pass``, ``fail`` or ``skip``; only ``fail`` fails the run, so a machine without
``amp_C`` (every kernel self-test skipped, the fallback serving every op) passes, and says so as
"the PyTorch path is verified, amp_C's kernels were not checked", with the reason once.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import IO, Any, Dict, Iterable, List, Optional

__all__ = ["PASS", "FAIL", "SKIP", "KERNELS", "Result", "Report", "error_line"]

PASS, FAIL, SKIP = "pass", "fail", "skip"
#: The section of the kernel self-tests: all skipped, the run verified the PyTorch path alone.
KERNELS = "amp_C kernels"


def error_line(err: BaseException) -> str:
    """``Type: the first line of its message``: an error as a report names it."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


@dataclasses.dataclass
class Result:
    """One check on one device.

    ``detail`` says what was compared, or for a failure the first mismatch or error (naming the op,
    the case and the tensor), or for a skip why. ``ratio`` is set by the timing only.
    """

    check: str
    device: str
    status: str
    detail: str
    cases: int = 0
    seconds: float = 0.0
    ratio: Optional[float] = None

    def line(self) -> str:
        """The progress line printed when the check finishes."""
        cases = f"{self.cases} cases, " if self.cases > 1 else ""
        took = "" if self.status == SKIP else f" ({self.seconds:.2f} s)"
        return f"  [{self.status}] {self.check} on {self.device}: {cases}{self.detail}{took}"

    def cell(self) -> str:
        """What the summary table shows for this check and device."""
        if self.status == PASS and self.ratio is not None:
            return f"pass {self.ratio:.2f}x"
        return self.status


@dataclasses.dataclass
class Report:
    """Everything one run found: the environment (see ``amp.check.environment``) and the results."""

    environment: Dict[str, Any]
    quick: bool
    results: List[Result] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    #: check -> the section it belongs to (``KERNELS`` for amp_C's kernels), for the summary.
    sections: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No check failed (skipped checks do not count against the run)."""
        return all(result.status != FAIL for result in self.results)

    @property
    def failures(self) -> List[Result]:
        return [result for result in self.results if result.status == FAIL]

    def add(self, result: Result, out: Optional[IO[str]], section: str = "") -> None:
        self.add_all([result], out, section)

    def add_all(self, results: Iterable[Result], out: Optional[IO[str]], section: str = "") -> None:
        """Add ``results`` of ``section`` as they come, printing a line for each, but one line
        for a run of skips on one device for one reason; a reason printed before is not repeated."""
        said = {r.detail for r in self.results if r.status == SKIP}
        for skipped, group in itertools.groupby(results, lambda r: (r.status == SKIP, r.device, r.detail)):
            batch = list(group)
            for result in batch:
                self.results.append(result)
                self.sections[result.check] = section
            if out is None:
                continue
            if not skipped[0]:
                for result in batch:
                    print(result.line(), file=out, flush=True)
                continue
            names = batch[0].check if len(batch) == 1 else f"{len(batch)} checks ({batch[0].check} ... {batch[-1].check})"
            why = "for the reason above" if batch[0].detail in said else batch[0].detail
            print(f"  [skip] {names} on {batch[0].device}: {why}", file=out, flush=True)
            said.add(batch[0].detail)

    def _rows(self, devices: List[str]) -> List[tuple[str, List[str]]]:
        """(label, cells) per check; a section whose checks are all skipped is one row."""
        cells = {(r.check, r.device): r.cell() for r in self.results}
        checks = list(dict.fromkeys(result.check for result in self.results))
        rows = []
        for section, group in itertools.groupby(checks, lambda check: self.sections.get(check, "")):
            names = list(group)
            table = [[cells.get((check, d), "-") for d in devices] for check in names]
            if section and len(names) > 1 and all(cell in (SKIP, "-") for row in table for cell in row):
                rows.append((f"{section} ({len(names)} checks)", table[0]))
            else:
                rows += list(zip(names, table))
        return rows

    def _verdict(self) -> str:
        counts = {status: sum(r.status == status for r in self.results) for status in (PASS, FAIL, SKIP)}
        tally = f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {self.seconds:.1f} s"
        kernels = [r for r in self.results if self.sections.get(r.check) == KERNELS]
        if not self.passed or not kernels or any(r.status != SKIP for r in kernels):
            return f"amp.check: {'PASSED' if self.passed else 'FAILED'}: {tally}"
        reasons = list(dict.fromkeys(r.detail for r in kernels))
        why = reasons[0] if len(reasons) == 1 else "see above"
        return (f"amp.check: PASSED: the PyTorch path is verified ({tally}); amp_C's kernels were not "
                f"checked ({why})")

    def summary(self) -> str:
        """A table, one row per check and one column per device, and a last verdict line."""
        devices = list(dict.fromkeys(result.device for result in self.results))
        rows = self._rows(devices)
        first = max([len("check"), *(len(label) for label, _ in rows)])
        widths = [max(len(device), 10) for device in devices]
        lines = ["  " + "check".ljust(first) + "".join(f"  {d:<{w}}" for d, w in zip(devices, widths))]
        for label, row in rows:
            lines.append("  " + label.ljust(first) + "".join(f"  {cell:<{w}}" for cell, w in zip(row, widths)))
        lines.append(self._verdict())
        for failure in self.failures:
            lines.append(f"  failed: {failure.check} on {failure.device}: {failure.detail}")
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        """The document ``--json FILE`` writes (docs/reference.md lists every field)."""
        return {
            "passed": self.passed,
            "quick": self.quick,
            "seconds": round(self.seconds, 3),
            **self.environment,
            "results": [dataclasses.asdict(result) for result in self.results],
        }
