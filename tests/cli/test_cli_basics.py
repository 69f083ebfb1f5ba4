"""The CLI's conventions: fast start without torch, help, version, completions kept fresh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import invoke, run_script

from ckptctl import __version__

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "checkpoint_engine", "safetensors", "numpy")

_PROBE = """
import sys
sys.argv = {argv!r}
from ckptctl.cli import main
try:
    main()
except SystemExit:
    pass
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r}))
sys.stderr.write("HEAVY=" + ",".join(heavy) + "\\n")
"""


def _heavy_imports(*argv: str) -> list[str]:
    code = _PROBE.format(argv=["ckptctl", *argv], heavy=HEAVY)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    line = [x for x in r.stderr.splitlines() if x.startswith("HEAVY=")][-1]
    return [m for m in line[len("HEAVY=") :].split(",") if m]


def _commands() -> list[str]:
    import typer.main

    from ckptctl.cli import app

    return sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_help_imports_neither_torch_nor_checkpoint_engine() -> None:
    assert _heavy_imports("--help") == []


@pytest.mark.parametrize("command", _commands())
def test_every_command_help_is_light(command: str) -> None:
    assert _heavy_imports(command, "--help") == []


def test_wait_ready_run_is_light() -> None:
    assert _heavy_imports("wait-ready", "--timeout", "0", "--endpoint", "http://127.0.0.1:9") == []


def test_help_lists_commands_and_exit_codes() -> None:
    r = invoke("--help")
    assert r.exit_code == 0
    for command in _commands():
        assert command in r.stdout
    assert "130 interrupted" in r.stdout


def test_version() -> None:
    r = run_script("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ckptctl {__version__}"


def test_no_arguments_shows_help_and_usage_exit_code() -> None:
    r = run_script()
    assert r.returncode == 2
    assert "Usage" in r.stdout + r.stderr


def test_debug_env_shows_traceback_only_when_set(tmp_path: Path) -> None:
    # An internal error is one line without CKPTCTL_DEBUG, a traceback with it.
    code = (
        "import typer\nfrom ckptctl.cli._errors import handle_errors\n"
        "app = typer.Typer()\n"
        "@app.command()\n@handle_errors\ndef boom() -> None:\n    raise ValueError('bad thing')\n"
        "app()\n"
    )
    for debug, expect_tb in (("", False), ("1", True)):
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "CKPTCTL_DEBUG": debug},
            timeout=30,
        )
        assert r.returncode == 1
        assert "internal error: ValueError: bad thing" in r.stderr
        assert ("Traceback" in r.stderr) is expect_tb


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completions_are_fresh(shell: str) -> None:
    """completions/ is generated from the CLI; regenerate with `make completions`."""
    committed = (ROOT / "completions" / f"ckptctl.{shell}").read_text()
    r = subprocess.run(
        [sys.executable, str(ROOT / "completions" / "generate.py"), "--print", shell],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == committed, f"completions/ckptctl.{shell} is stale: run `make completions`"


def test_bash_completion_completes_commands_and_choices() -> None:
    env = {
        **os.environ,
        "_CKPTCTL_COMPLETE": "complete_bash",
        "COMP_WORDS": "ckptctl wait",
        "COMP_CWORD": "1",
    }
    r = run_script(env=env)
    assert "wait-ready" in r.stdout
    env.update(COMP_WORDS="ckptctl wait-ready --for ", COMP_CWORD="3")
    r = run_script(env=env)
    assert "listening" in r.stdout and "healthy" in r.stdout


def test_json_flag_everywhere() -> None:
    for command in _commands():
        r = invoke(command, "--help")
        assert "--json" in r.stdout, command


def test_results_json_is_single_document() -> None:
    r = invoke("wait-ready", "--timeout", "0", "--json", "--endpoint", "http://127.0.0.1:9")
    assert json.loads(r.stdout)["ready"] is False


# -- installing completion for the shell named (issue 25, item 6) -------------------------------

INSTALLED = {
    "bash": ".bash_completions/ckptctl.sh",
    "zsh": ".zfunc/_ckptctl",
    "fish": ".config/fish/completions/ckptctl.fish",
}


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_show_completion_prints_the_script_of_the_shell_named(shell: str) -> None:
    """`--show-completion fish` printed the bash script (the shell it ran in)."""
    r = run_script("--show-completion", shell, env={**os.environ, "SHELL": "/bin/bash"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "completions" / f"ckptctl.{shell}").read_text()


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_install_completion_installs_the_shell_named_in_a_fresh_home(
    shell: str, tmp_path: Path
) -> None:
    """`--install-completion zsh` installed bash completion; into a home with none of the
    folders (the README's `cp` commands failed there), twice (the start-up line goes in once)."""
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    for _ in range(2):
        r = run_script("--install-completion", shell, env=env)
        assert r.returncode == 0, r.stderr
    assert f"{shell} completion installed in {tmp_path / INSTALLED[shell]}" in r.stderr
    committed = (ROOT / "completions" / f"ckptctl.{shell}").read_text()
    assert (tmp_path / INSTALLED[shell]).read_text() == committed
    others = [s for s in INSTALLED if s != shell]
    assert not any((tmp_path / INSTALLED[s]).exists() for s in others)
    startup = {
        "bash": (".bashrc", f"source '{tmp_path / INSTALLED['bash']}'"),
        "zsh": (".zshrc", "fpath+=~/.zfunc; autoload -Uz compinit; compinit"),
    }
    for name, (rc, line) in startup.items():
        written = (tmp_path / rc).read_text().splitlines() if (tmp_path / rc).exists() else []
        assert written == ([line] if name == shell else [])


def test_the_installed_bash_completion_loads_without_bash_completion(tmp_path: Path) -> None:
    """What --install-completion bash adds to ~/.bashrc defines the completion in a plain bash
    (no bash-completion package needed)."""
    env = {**os.environ, "HOME": str(tmp_path)}
    assert run_script("--install-completion", "bash", env=env).returncode == 0
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    r = subprocess.run(
        [bash, "--norc", "-c", f"source {tmp_path / '.bashrc'} && complete -p ckptctl"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "-F _ckptctl_completion" in r.stdout and "ckptctl" in r.stdout


def test_completion_for_an_unknown_shell_is_a_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path)}
    for option in ("--install-completion", "--show-completion"):
        r = run_script(option, "powershell", env=env)
        assert r.returncode == 2
        assert r.stderr.splitlines() == [
            f"error: {option} takes one of bash, zsh, fish, not 'powershell' (see ckptctl --help)"
        ]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_a_command_starts_is_one_line_and_exit_130() -> None:
    """A real SIGINT while the CLI still imports its commands (here: at the start of `run`),
    before any command can catch it: was a KeyboardInterrupt traceback."""
    program = (
        "import os, signal, time\n"
        "import ckptctl.cli as cli\n"
        "def run(args):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "cli.run = run\n"
        "cli.main(['doctor', '--json'])\n"
    )
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130, r.stderr
    assert r.stderr == "error: interrupted\n", r.stderr
    assert json.loads(r.stdout) == {"ok": False, "exit_code": 130, "error": "interrupted"}


def test_ctrl_c_just_after_a_command_ended_keeps_its_exit_code() -> None:
    program = (
        "import os, signal, time\n"
        "import ckptctl.cli as cli\n"
        "import ckptctl.cli._errors as errors\n"
        "def restore():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "errors.restore_default_signal_handlers = restore\n"
        "cli.run = lambda args: 4\n"
        "cli.main(['wait-ready'])\n"
    )
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert r.returncode == 4 and r.stderr == "", r.stderr
