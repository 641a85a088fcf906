"""Shell examples of the project's Markdown documents, parsed and run as written.

Shared by the tests that execute README.md (tests/integration/test_readme_shell.py)
and deploy/DEPLOY.md (tests/integration/test_deploy_docs.py,
tests/container/test_deploy_docs_containers.py). A document's ```sh blocks
hold commands (a line ending in `\\` continues on the next; blank and `#`
lines are skipped; a here-document is part of its command); a plain ``` block
with `$ ` lines is a transcript (each `$` line a command, the lines under it
its output); any other plain ``` block is output or text and must hold
nothing that looks like a command.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from geofed.routing import Federation

# The documented variable parts of shown output, applied to both the document's
# text and the actual stdout before they are compared.
NORMALISE: list[tuple[str, str]] = [
    # absolute path of the working directory in Spark's file: URIs
    # (README shows the checkout, the test runs in a temp dir)
    (r"file:/\S*?/out/", "file:<cwd>/out/"),
    # ports chosen at start
    (r"127\.0\.0\.1:\d+", "127.0.0.1:<port>"),
    # elapsed times
    (r"\bin \d+(?:\.\d+)? ?s\b", "in <time>"),
]

# First words that make a line of a plain block look like a command.
COMMAND_WORDS = ("geofed", "make", "python", "pip", "spark-submit", "kubectl", "docker")

HANG_GUARD_S = 900  # only against a hung process: nothing waits on the clock

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Command:
    doc: str  # the document's file name, for messages
    text: str  # as the document writes it (continuations joined)
    line: int  # line number in the document
    output: list[str] | None = None  # shown output (`$` lines), None in sh blocks

    @property
    def key(self) -> str:
        """The command without a trailing `# ...` comment, blanks collapsed."""
        return " ".join(re.sub(r"\s+#\s.*$", "", self.text).split())

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass
class Block:
    kind: str  # "sh" or "transcript"
    line: int
    commands: list[Command] = field(default_factory=list)


def _fenced_blocks(doc: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first body line, body lines) of every fenced block."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        end = lines.index("```", i + 1)
        blocks.append((m.group(1), i + 2, lines[i + 1 : end]))
        i = end + 1
    return blocks


def _looks_like_command(line: str) -> bool:
    first = line.split(maxsplit=1)[0] if line.strip() else ""
    return first in COMMAND_WORDS or bool(re.match(r"^[A-Z_]+=\S*$", first))


def shell_blocks(doc: Path) -> list[Block]:
    """The shell examples of `doc`, in order."""
    name = str(doc.resolve().relative_to(ROOT))
    out: list[Block] = []
    for lang, first, body in _fenced_blocks(doc):
        if lang == "sh":
            block = Block("sh", first)
            pending, start, heredoc = "", 0, ""
            for n, raw in enumerate(body, first):
                if heredoc:  # the here-document's lines belong to the command as they are
                    block.commands[-1].text += "\n" + raw
                    heredoc = "" if raw == heredoc else heredoc
                    continue
                if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
                    continue
                start = start if pending else n
                if raw.endswith("\\"):
                    pending += raw[:-1]
                    continue
                block.commands.append(Command(name, " ".join((pending + raw).split()), start))
                pending = ""
                m = re.search(r"<<-?\s*'?(\w+)'?", raw)
                heredoc = m.group(1) if m else ""
            assert not heredoc, f"{name}:{start}: here-document without its {heredoc} line"
            assert not pending, f"{name}:{start}: continuation line at the end of a block"
            out.append(block)
        elif lang == "" and any(line.startswith("$ ") for line in body):
            block = Block("transcript", first)
            for n, raw in enumerate(body, first):
                if raw.startswith("$ "):
                    block.commands.append(Command(name, raw[2:], n, []))
                else:
                    assert block.commands, f"{name}:{n}: output before the first `$` line"
                    output = block.commands[-1].output
                    assert output is not None
                    output.append(raw)
            out.append(block)
        elif lang == "":
            for n, raw in enumerate(body, first):
                assert not _looks_like_command(raw), (
                    f"{name}:{n}: {raw!r} looks like a command in a plain block: "
                    "put it in a ```sh block (run by its test or listed in its NOT_RUN), "
                    "write it as a `$ ` transcript, or mark a synopsis ```text"
                )
    return out


def check_inventory(blocks: list[Block], not_run: dict[str, str]) -> list[Command]:
    """The commands to run: every command of `blocks` not in `not_run` (command -> reason).

    Fails on a `not_run` entry the document no longer has, an empty reason, or
    nothing left to run, so a document cannot gain an unchecked example.
    """
    commands = [c for b in blocks for c in b.commands]
    stale = sorted(set(not_run) - {c.key for c in commands})
    assert not stale, f"NOT_RUN lists commands the document no longer has: {stale}"
    assert all(reason.strip() for reason in not_run.values())
    run = [c for c in commands if c.key not in not_run]
    assert run, "no command of the document is run"
    return run


def normalise(text: str) -> str:
    for pattern, repl in NORMALISE:
        text = re.sub(pattern, repl, text)
    return text


def matches(shown: list[str], actual: list[str]) -> bool:
    """`actual` equals `shown`, where a `...` line in `shown` stands for any lines."""
    if not shown:
        return not actual
    if shown[0] == "...":
        return any(matches(shown[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and shown[0] == actual[0] and matches(shown[1:], actual[1:])


def run(cmd: Command, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`cmd` through bash in `cwd`; it must exit 0."""
    out = subprocess.run(
        ["bash", "-c", cmd.text],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert out.returncode == 0, (
        f"{cmd.where}: `{cmd.text}` exited {out.returncode}\n"
        f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    )
    return out


def check_transcript(block: Block, cwd: Path, env: dict[str, str], not_run: dict[str, str]) -> None:
    """Each `$` command of a transcript runs and prints what the document shows."""
    for cmd in block.commands:
        if cmd.key in not_run:
            continue
        out = run(cmd, cwd, env)
        assert cmd.output is not None
        shown = normalise("\n".join(cmd.output)).split("\n") if cmd.output else []
        actual = normalise(out.stdout.rstrip("\n")).split("\n") if out.stdout else []
        assert matches(shown, actual), (
            f"{cmd.where}: `{cmd.text}` printed\n{out.stdout}\nthe document shows\n"
            + "\n".join(cmd.output)
        )


def deploy_guide_federation(cwd: Path) -> Path:
    """deploy/DEPLOY.md's federation file for brokers as containers, in `cwd`.

    The three-broker federation with each broker's peer endpoint at its network
    alias (`geofed-<id>:7401`) and its client endpoint on the host (`eu`, the
    one the guide runs, at 127.0.0.1:7400).
    """
    three = Federation.load(ROOT / "deploy" / "federations" / "three.geojson")
    others = [b.id for b in three.brokers if b.id != "eu"]
    ports = {"eu": 7400} | {bid: 7410 + 10 * i for i, bid in enumerate(others)}
    fed = three.with_endpoints(
        {bid: (f"geofed-{bid}:7401", f"127.0.0.1:{port}") for bid, port in ports.items()}
    )
    path = cwd / "federation.geojson"
    path.write_text(json.dumps(fed.to_geojson()), encoding="utf-8")
    return path
