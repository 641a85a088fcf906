"""Repo-level test hooks.

Skips fail CI unless allowed. When GEOFED_ALLOWED_SKIPS is set (.ci/run exports
it, possibly empty), every skipped test or collector whose reason matches none
of its lines (Python regular expressions, searched in the skip reason; blank
lines and lines starting with '#' are ignored) is listed at the end of the run
and turns a passing exit status into a failure (exit status 1). An expected
failure (xfail) is not a skip. Without the variable, skips are only reported,
as usual (`-ra`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

import pytest

ALLOWED_SKIPS_ENV = "GEOFED_ALLOWED_SKIPS"


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason given to pytest.skip / skipif / importorskip, without pytest's prefix."""
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@dataclass(eq=False)  # a plugin object must stay hashable
class SkipGate:
    """Collects the skips that no allow-list pattern matches and fails the session on them."""

    allowed: list[re.Pattern[str]]
    disallowed: list[tuple[str, str]] = field(default_factory=list)

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = skip_reason(report)
        if not any(p.search(reason) for p in self.allowed):
            self.disallowed.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def _lines(self) -> list[str]:
        head = (
            f"{len(self.disallowed)} skip(s) not allowed by {ALLOWED_SKIPS_ENV} "
            "(the allow-list in .ci/run): the run fails"
        )
        return [head] + [f"SKIPPED {nodeid}: {reason}" for nodeid, reason in self.disallowed]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.disallowed:
            return
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if session.config.pluginmanager.get_plugin("terminalreporter") is None:
            print("\n".join(self._lines()), file=sys.stderr)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.disallowed:
            return
        head, *rest = self._lines()
        terminalreporter.section("disallowed skips", sep="=", red=True, bold=True)
        terminalreporter.line(head, red=True, bold=True)
        for line in rest:
            terminalreporter.line(line)


def pytest_configure(config: pytest.Config) -> None:
    raw = os.environ.get(ALLOWED_SKIPS_ENV)
    if raw is None:
        return
    allowed: list[re.Pattern[str]] = []
    for line in raw.splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        try:
            allowed.append(re.compile(pattern))
        except re.error as exc:
            raise pytest.UsageError(
                f"{ALLOWED_SKIPS_ENV}: bad pattern {pattern!r}: {exc}"
            ) from None
    config.pluginmanager.register(SkipGate(allowed), "geofed-skip-gate")
