"""Running the CLI as a test sees it: in-process (Typer's CliRunner) or as the installed script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from ckptctl.cli import app


def invoke(*args: str, env: Mapping[str, str | None] | None = None):  # type: ignore[no-untyped-def]
    """Run the CLI in-process (Typer's CliRunner keeps stdout and stderr apart); `env`: values
    set for the call, None removes one."""
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


def ckptctl_script() -> str:
    """The installed console script next to this interpreter."""
    script = Path(sys.executable).with_name("ckptctl")
    return str(script) if script.exists() else shutil.which("ckptctl") or "ckptctl"


def run_script(
    *args: str, timeout: float = 60, env: Mapping[str, str | None] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run the installed `ckptctl` as a user would: this environment, without CKPTCTL_DEBUG
    (its tracebacks are not what a user sees), plus `env` (None removes a variable)."""
    full_env = {k: v for k, v in os.environ.items() if k != "CKPTCTL_DEBUG"}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run(
        [ckptctl_script(), *args], capture_output=True, text=True, timeout=timeout,
        env=full_env, **kw,
    )  # fmt: skip
