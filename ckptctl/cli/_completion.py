"""`ckptctl --install-completion SHELL` and `--show-completion SHELL` for the shell named.

Typer's own options take no value: they detect the shell they run in, and a shell named after
them was ignored (`--install-completion zsh` installed bash completion and exited 0). A named
shell is handled here; without one, Typer's options do what their help says. The script is
Typer's, asked for the way the installed scripts ask (`_CKPTCTL_COMPLETE=source_<shell>`).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptctl.errors import UsageError

SHELLS = ("bash", "zsh", "fish")
OPTIONS = ("--install-completion", "--show-completion")
COMPLETE_ENV = "_CKPTCTL_COMPLETE"


def requested(args: Sequence[str]) -> tuple[str, str] | None:
    """(option, shell) when `args` is `--install-completion SHELL` or `--show-completion SHELL`
    (or `--option=SHELL`); None otherwise, Typer's detecting form included."""
    if not args:
        return None
    option, _, value = args[0].partition("=")
    if option not in OPTIONS:
        return None
    if not value and len(args) > 1 and not args[1].startswith("-"):
        value = args[1]
    if not value:
        return None
    if value not in SHELLS:
        raise UsageError(f"{option} takes one of {', '.join(SHELLS)}, not {value!r}")
    return option, value


def script(shell: str, run_app: Callable[[], object]) -> str:
    """Typer's completion script for `shell`, from the app itself (`run_app` runs it)."""
    saved = os.environ.get(COMPLETE_ENV)
    os.environ[COMPLETE_ENV] = f"source_{shell}"
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
            run_app()
    finally:
        if saved is None:
            os.environ.pop(COMPLETE_ENV, None)
        else:
            os.environ[COMPLETE_ENV] = saved
    # Typer's scripts start with a blank line, and zsh loads a completion file only when its
    # first line is `#compdef ckptctl`.
    text = buffer.getvalue().lstrip("\n")
    if not text.strip():
        raise RuntimeError(f"Typer wrote no {shell} completion script")
    return text


def install(shell: str, text: str, home: Path) -> tuple[Path, str]:
    """Write the script where `shell` finds it, creating the folders; for bash and zsh also add
    the one line their start-up file needs (once). Returns (script path, how to load it)."""
    if shell == "fish":  # fish loads ~/.config/fish/completions/ by itself
        path = home / ".config" / "fish" / "completions" / "ckptctl.fish"
        rc, line = None, ""
    elif shell == "zsh":
        path = home / ".zfunc" / "_ckptctl"
        rc, line = home / ".zshrc", "fpath+=~/.zfunc; autoload -Uz compinit; compinit"
    else:  # sourced from ~/.bashrc: works without the bash-completion package
        path = home / ".bash_completions" / "ckptctl.sh"
        rc, line = home / ".bashrc", f"source '{path}'"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if rc is None:
        return path, "open a new fish shell"
    existing = rc.read_text() if rc.is_file() else ""
    if line not in existing.splitlines():
        with rc.open("a") as fh:
            fh.write(("\n" if existing and not existing.endswith("\n") else "") + line + "\n")
    return path, f"loaded from {rc}: open a new {shell} shell"
