"""Regenerate the shell completion scripts in this folder from the CLI (`make completions`).

Typer writes them (`_CKPTCTL_COMPLETE=source_<shell>`); the scripts call `ckptctl` back to
complete commands, flags and choices. `tests/test_cli_basics.py` fails when they are stale.

    python completions/generate.py            # rewrite ckptctl.bash, ckptctl.zsh, ckptctl.fish
    python completions/generate.py --print bash
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHELLS = ("bash", "zsh", "fish")
HERE = Path(__file__).resolve().parent


def render(shell: str) -> str:
    env = {**os.environ, "_CKPTCTL_COMPLETE": f"source_{shell}"}
    code = "from ckptctl.cli import main; main()"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    # Typer's scripts start with a blank line, and zsh loads a completion file only when its
    # first line is `#compdef ckptctl`.
    return r.stdout.lstrip("\n")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--print"]:
        sys.stdout.write(render(argv[1]))
        return
    for shell in SHELLS:
        (HERE / f"ckptctl.{shell}").write_text(render(shell))
        print(f"wrote completions/ckptctl.{shell}")


if __name__ == "__main__":
    main(sys.argv[1:])
