"""The pages beside the README: docs/cli.md is what the CLI generates now (`make docs`), the
same in any terminal and environment, and every relative link in README.md, SECURITY.md and
docs/*.md leads to a file, and to a heading of it where it names one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "generate_cli.py"
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]


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


def _headings(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (outside code blocks)."""
    anchors, in_code = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        in_code ^= line.startswith("```")
        if not in_code and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _links(page: Path) -> list[str]:
    """The page's link targets, outside code blocks."""
    links, in_code = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        in_code ^= line.startswith("```")
        if not in_code:
            links += re.findall(r"\]\(([^)\s]+)\)", line)
    return links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
            continue
        if anchor and target.suffix == ".md" and anchor not in _headings(target):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_the_link_check_sees_the_links() -> None:
    """(It would pass on pages whose links it failed to find.)"""
    readme = _links(ROOT / "README.md")
    assert "docs/serve.md" in readme and "SECURITY.md" in readme
    assert "security-what-you-must-protect" in _headings(ROOT / "README.md")
    assert "try-serve-without-a-gpu" in _headings(ROOT / "README.md")
