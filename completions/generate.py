"""Regenerate the shell completion scripts in this folder from the CLI (`make completions`).

Typer writes them (`_CKPTCTL_COMPLETE=source_<shell>`, as `ckptctl --show-completion SHELL`
does); the scripts call `ckptctl` back to complete commands, flags and choices. `tests/cli/test_cli_basics.py` fails when they are stale.

    python completions/generate.py            # rewrite ckptctl.bash, ckptctl.zsh, ckptctl.fish
    python completions/generate.py --print bash
"""

from __future__ import annotations

import sys
from pathlib import Path

SHELLS = ("bash", "zsh", "fish")
HERE = Path(__file__).resolve().parent


def render(shell: str) -> str:
    from ckptctl.cli import app
    from ckptctl.cli._completion import script

    return script(shell, lambda: app([], prog_name="ckptctl"))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--print"]:
        sys.stdout.write(render(argv[1]))
        return
    for shell in SHELLS:
        (HERE / f"ckptctl.{shell}").write_text(render(shell))
        print(f"wrote completions/ckptctl.{shell}")


if __name__ == "__main__":
    main(sys.argv[1:])
