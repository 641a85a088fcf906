"""README's Python examples run as printed and print what README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def _section_blocks(heading: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced block in the README section under `heading`."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize(
    "heading", ["Using geofed from Python", "Delivery guarantee", "Message history"]
)
def test_python_example_runs_as_printed(heading: str, tmp_path: Path) -> None:
    blocks = _section_blocks(heading)
    (code,) = [body for lang, body in blocks if lang == "python"]
    (expected,) = [body for lang, body in blocks if lang == ""]
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected
