"""Names a checkpoint or a metas file brings (shards, tensors, the checkpoint's name) and paths
reach the terminal as text: an escape sequence in a shard's name (`<ESC>]0;PWNED<ESC>\\`
retitles the window, `<ESC>[2J` clears the screen) shows as `\\x1b`, in error lines, warnings,
tables and logs alike. The JSON document keeps every name exactly (JSON escapes it itself)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from ckpt_factory import write_real_checkpoint
from cli_run import invoke
from metas_samples import owner, param
from rich.table import Table
from rich.text import Text

from ckptctl.cli._output import TerminalConsole
from ckptctl.errors import print_error, terminal_text
from ckptctl.metas import write_metas_file

HOSTILE = "model\x1b]0;PWNED\x1b\\\x1b[2J\u202e"
SHOWN = "model\\x1b]0;PWNED\\x1b\\\\x1b[2J\\u202e"  # as the terminal shows it


def test_terminal_text_escapes_what_a_terminal_would_act_on() -> None:
    assert terminal_text(HOSTILE) == SHOWN
    assert terminal_text("a\nb\tc\x9b") == "a\\nb\\tc\\x9b"
    assert terminal_text("a\nb", lines=True) == "a\nb"
    assert terminal_text("plain ünïcode 名前 [x]") == "plain ünïcode 名前 [x]"


def test_an_error_line_is_one_clean_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_error(f"/ckpt/{HOSTILE}.safetensors: is truncated\nsecond line")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and err.count("\n") == 1
    assert f"/ckpt/{SHOWN}.safetensors: is truncated\\nsecond line" in err


def test_rich_output_keeps_its_own_styles_and_escapes_the_names() -> None:
    buffer = io.StringIO()
    console = TerminalConsole(
        file=buffer, force_terminal=True, color_system="standard", highlight=False, width=200
    )
    table = Table(title="split")
    table.add_column("name")
    table.add_row(HOSTILE)
    table.add_row(Text(f"{HOSTILE}!", style="red"))  # (a Text: escaped as it is drawn)
    console.print(table)
    console.print(f"log: {HOSTILE}", style="yellow", markup=False)
    shown = buffer.getvalue()
    assert "\x1b[31m" in shown and "\x1b[33m" in shown  # Rich's own colours still work
    assert "\x1b]" not in shown and "\x1b[2J" not in shown and "\u202e" not in shown
    assert shown.count(SHOWN) == 3


def test_a_pushs_progress_on_a_terminal_is_one_escaped_line() -> None:
    """`push` redraws the job's words for the push under way (its label names the checkpoint)
    in place on the terminal: escaped, and one line."""
    from ckptctl.cli._output import Output
    from ckptctl.cli.serve import PushProgress

    buffer = io.StringIO()
    out = Output()
    out.err = TerminalConsole(file=buffer, force_terminal=True, width=200)
    running = {"seq": 3, "label": f"reading /ckpt/{HOSTILE}\nerror: forged", "detail": HOSTILE}
    PushProgress(out).show(running)
    shown = buffer.getvalue()
    assert shown.startswith("\r\x1b[2K") and "\n" not in shown  # (its own redraw only)
    assert "\x1b]" not in shown and "\x1b[2J" not in shown and "\u202e" not in shown
    assert shown.count(SHOWN) == 2 and f"{SHOWN}\\nerror: forged" in shown


def test_the_live_views_log_lines_are_one_line_each() -> None:
    """On rank 0's terminal the job's lines go through the live view: a path or version
    holding a line break adds no line (an "error: ..." of its own) there either."""
    from ckptctl.progress import RichReporter

    buffer = io.StringIO()
    reporter = RichReporter(TerminalConsole(file=buffer, force_terminal=True, width=200))
    try:
        reporter.log(f"push 1 (/ckpt/{HOSTILE}\nerror: forged): done in 0.05s")
        reporter.warn("verify: weight version 'v1\nerror: forged'")
    finally:
        reporter.close()
    shown = buffer.getvalue()
    assert "\nerror: forged" not in shown and shown.count("\\nerror: forged") == 2
    assert "\x1b]" not in shown and "\u202e" not in shown


@pytest.fixture
def hostile_metas(tmp_path: Path) -> Path:
    path = tmp_path / "m.json"
    metas = {0: owner([param(f"{HOSTILE}.weight", torch.float32, (4,))], 0)}
    write_metas_file(path, metas, checkpoint_name=f"ck{HOSTILE}", world_size=1)
    return path


def test_inspect_metas_shows_forged_names_escaped(hostile_metas: Path) -> None:
    human = invoke("inspect-metas", str(hostile_metas))
    assert human.exit_code == 0, human.stderr
    assert "\x1b" not in human.stdout and "\u202e" not in human.stdout
    assert f"checkpoint ck{SHOWN}" in human.stdout
    assert "PWNED" in human.stdout.split("checkpoint ck")[1]  # the tensor's name, in a table
    doc = json.loads(invoke("inspect-metas", str(hostile_metas), "--json").stdout)
    assert doc["checkpoint_name"] == f"ck{HOSTILE}"  # JSON: exact


def test_the_dry_run_shows_a_hostile_shard_escaped(tmp_path: Path) -> None:
    root = write_real_checkpoint(
        tmp_path / "ck", [{"a": torch.ones(4)}], names=["good.safetensors"]
    )
    # A shard the directory holds but no index names: the dry run warns about it by name.
    write_real_checkpoint(root, [{"b": torch.ones(4)}], names=[f"{HOSTILE}.safetensors"])
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "good.safetensors"}})
    )
    args = ["update", "--dry-run", "--checkpoint-path", str(root), "--world-size", "1",
            "--inference-parallel-size", "1"]  # fmt: skip
    warned = invoke(*args)
    assert warned.exit_code == 0, warned.stderr
    assert "\x1b" not in warned.stderr and f"{SHOWN}.safetensors" in warned.stderr

    (root / "model.safetensors.index.json").unlink()
    (root / f"{HOSTILE}.safetensors").write_bytes(b"\x10\x00")  # cut short
    failed = invoke(*args)
    assert failed.exit_code == 3
    assert "\x1b" not in failed.stderr and f"{SHOWN}.safetensors: is truncated" in failed.stderr
    as_json = invoke(*args, "--json")
    assert f"{HOSTILE}.safetensors: is truncated" in json.loads(as_json.stdout)["error"]


def test_a_status_like_text_keeps_its_lines_and_escapes_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What `status` shows (Output.show of each of its lines): its own lines stay; a line
    break inside one (a folder named "x\\nerror: ...") is escaped with the rest."""
    from ckptctl.cli._output import Output

    out = Output()
    for line in ("serving: my-ckpt", f"last push: /ckpt/{HOSTILE}\nerror: forged failed"):
        out.show(line)
    shown = capsys.readouterr().out
    assert shown == f"serving: my-ckpt\nlast push: /ckpt/{SHOWN}\\nerror: forged failed\n"
