"""The results of ``python -m amp.check``: one record per check and device, the summary table,
and the JSON document (its fields are listed in the README's "Check your installation").

A record is ``pass``, ``fail`` or ``skip``; only ``fail`` fails the run, so a machine without
``amp_C`` (every kernel self-test skipped, the fallback serving every op) passes.
"""
from __future__ import annotations

import dataclasses
from typing import IO, Any, Dict, List, Optional

__all__ = ["PASS", "FAIL", "SKIP", "Result", "Report"]

PASS, FAIL, SKIP = "pass", "fail", "skip"


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

    @property
    def passed(self) -> bool:
        """No check failed (skipped checks do not count against the run)."""
        return all(result.status != FAIL for result in self.results)

    @property
    def failures(self) -> List[Result]:
        return [result for result in self.results if result.status == FAIL]

    def add(self, result: Result, out: Optional[IO[str]]) -> None:
        self.results.append(result)
        if out is not None:
            print(result.line(), file=out, flush=True)

    def summary(self) -> str:
        """A table, one row per check and one column per device, and a last verdict line."""
        devices = list(dict.fromkeys(result.device for result in self.results))
        checks = list(dict.fromkeys(result.check for result in self.results))
        cells = {(r.check, r.device): r.cell() for r in self.results}
        first = max([len("check"), *(len(check) for check in checks)])
        widths = [max(len(device), 10) for device in devices]
        lines = ["  " + "check".ljust(first) + "".join(f"  {d:<{w}}" for d, w in zip(devices, widths))]
        for check in checks:
            row = "".join(f"  {cells.get((check, d), '-'):<{w}}" for d, w in zip(devices, widths))
            lines.append("  " + check.ljust(first) + row)
        counts = {status: sum(r.status == status for r in self.results) for status in (PASS, FAIL, SKIP)}
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"amp.check: {verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, "
                     f"{counts[SKIP]} skipped in {self.seconds:.1f} s")
        for failure in self.failures:
            lines.append(f"  failed: {failure.check} on {failure.device}: {failure.detail}")
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        """The document ``--json FILE`` writes (the README lists every field)."""
        return {
            "passed": self.passed,
            "quick": self.quick,
            "seconds": round(self.seconds, 3),
            **self.environment,
            "results": [dataclasses.asdict(result) for result in self.results],
        }
