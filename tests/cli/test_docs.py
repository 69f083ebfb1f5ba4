"""docs/cli.md is what the CLI generates now (`make docs`), the same in any terminal and
environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "generate_cli.py"


def _generate(tmp_path: Path, env: dict[str, str] | None = None) -> str:
    out = tmp_path / "cli.md"
    r = subprocess.run(
        [sys.executable, str(GENERATOR), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return out.read_text(encoding="utf-8")


def test_the_cli_reference_is_what_the_cli_generates_now(tmp_path: Path) -> None:
    committed = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert _generate(tmp_path) == committed, "docs/cli.md is stale: run `make docs`"


def test_the_cli_reference_is_the_same_in_any_terminal_and_environment(tmp_path: Path) -> None:
    """What could change Typer's and Rich's output (a narrow terminal, colours, Typer without
    Rich) or the help's defaults (a CKPTCTL_* variable) does not reach the generator."""
    env = {
        **os.environ,
        "COLUMNS": "40",
        "TERMINAL_WIDTH": "40",
        "TERM": "xterm-256color",
        "FORCE_COLOR": "1",
        "TYPER_USE_RICH": "0",
        "CKPTCTL_ENDPOINT": "http://elsewhere:1",
        "CKPTCTL_ENGINE": "vllm",
    }
    assert _generate(tmp_path, env) == (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def test_the_cli_reference_has_every_command_with_its_examples_as_markdown() -> None:
    from ckptctl.cli._app import COMMANDS

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in COMMANDS:
        section = text.split(f"## `ckptctl {command}`\n", 1)[1].split("\n## ", 1)[0]
        assert "**Examples**:\n\n```sh\n" in section, command
    assert "[bold]" not in text and "&#x27;" not in text  # (Rich markup, HTML escapes)
