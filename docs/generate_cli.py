"""Regenerate docs/cli.md, the command reference, from the CLI itself (`make docs`).

Typer writes it (`python -m typer ckptctl.cli._app utils docs`: every command's --help as
Markdown), in a process of its own with a fixed environment, so that a developer's terminal and
CI get the same file. Two touches follow: each command's examples and exit codes (Rich markup,
made for the terminal, which Typer copies as it is) become a shell block and a line, and the
HTML escapes Typer puts in the help texts become the quotes, `&` and `>` they stand for (`<`
stays escaped: Markdown would take it for a tag). `tests/cli/test_docs.py` fails when
docs/cli.md is not what this writes now.

    python docs/generate_cli.py              # rewrite docs/cli.md
    python docs/generate_cli.py OUTPUT       # write it elsewhere (the test does)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "cli.md"

# Nothing from the caller's environment reaches Typer and Rich: no terminal width, colour,
# locale or CKPTCTL_* setting can change the file.
ENVIRONMENT = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb", "PYTHONUTF8": "1"}

HEADER = (
    "Every command and flag, as `ckptctl COMMAND --help` shows them: generated from the CLI by "
    "`make docs` (docs/generate_cli.py), not to be edited by hand. What holds across commands "
    "(`--timeout`, `--wait`, `--json`, the logs, older flag names) is in "
    "[cli-conventions.md](cli-conventions.md)."
)

UNESCAPED = {"&#x27;": "'", "&quot;": '"', "&gt;": ">", "&amp;": "&"}  # (&amp; last)


def typer_markdown() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cli.md"
        subprocess.run(
            [sys.executable, "-m", "typer", "ckptctl.cli._app", "utils", "docs"]
            + ["--name", "ckptctl", "--output", str(out)],
            cwd=ROOT,
            env=ENVIRONMENT,
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=120,
        )
        return out.read_text(encoding="utf-8")


def epilog_markdown(command: str | None) -> str:
    from ckptctl.cli import _help

    examples = _help.EXAMPLES.get(command or "", []) if command else _help.OVERVIEW_EXAMPLES
    parts = ["**Examples**:\n\n```sh\n" + "\n".join(examples) + "\n```"] if examples else []
    if command is None:
        parts.append(_help.COMPLETION_HELP)
    parts.append(_help.EXIT_CODES_HELP)
    return "\n\n".join(parts)


def render() -> str:
    from ckptctl.cli import _help
    from ckptctl.cli._app import COMMANDS

    text = typer_markdown()
    for command in [None, *COMMANDS]:  # in the file's order: the overview, then each command
        rich_epilog = _help.epilog(command)
        start = text.index(f"# `ckptctl {command}`") if command else 0
        at = text.index(rich_epilog, start)  # (a ValueError here: Typer's layout changed)
        text = text[:at] + epilog_markdown(command) + text[at + len(rich_epilog) :]
    for escaped, plain in UNESCAPED.items():
        text = text.replace(escaped, plain)
    title, _, rest = text.partition("\n\n")
    return f"{title}\n\n{HEADER}\n\n{rest}"


def main(argv: list[str]) -> None:
    target = Path(argv[0]) if argv else TARGET
    target.write_text(render(), encoding="utf-8")
    print(f"wrote {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")


if __name__ == "__main__":
    main(sys.argv[1:])
