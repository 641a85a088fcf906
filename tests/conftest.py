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
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from geofed.bench import free_ports

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


# -- a throw-away PostgreSQL with PostGIS (the history's PostGIS backend) ------------

POSTGRES_DSN_ENV = "GEOFED_TEST_POSTGRES_DSN"
"""A DSN of a PostgreSQL with PostGIS to test against instead of starting one."""


def _postgres_bin() -> Path | None:
    """The folder of initdb/pg_ctl: on PATH, else Debian's newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A PostgreSQL server with PostGIS for the session: its DSN.

    `GEOFED_TEST_POSTGRES_DSN` names one to use; otherwise a cluster is made
    with initdb in a temporary folder and started with pg_ctl on a free
    loopback port (as the ``postgres`` user when running as root, which
    initdb refuses), then stopped and deleted. No server and no binaries is
    a failure, never a skip: .ci/run installs Debian's postgresql and postgis.
    """
    given = os.environ.get(POSTGRES_DSN_ENV)
    if given:
        yield given
        return
    bindir = _postgres_bin()
    if bindir is None:
        pytest.fail(
            "no PostgreSQL binaries (initdb, pg_ctl) and no "
            f"{POSTGRES_DSN_ENV}: install Debian's postgresql and postgis (see .ci/run)"
        )
    # Not under pytest's base temp (mode 0700, root's): the postgres user must reach it.
    root = Path(tempfile.mkdtemp(prefix="geofed-postgres-"))
    data = root / "data"
    prefix: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    (port,) = free_ports(1)

    def run(*args: str) -> None:
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, check=False)
        if done.returncode:
            pytest.fail(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")

    run(str(bindir / "initdb"), "-D", str(data), "-U", "geofed", "--auth=trust", "-E", "UTF8")
    options = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={root}"
    run(
        str(bindir / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(root / "log"),
        "-w",
        "start",
    )
    try:
        yield f"postgresql://geofed@127.0.0.1:{port}/postgres"
    finally:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
