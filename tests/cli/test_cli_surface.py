"""The command line as scripts see it (issue 15): one JSON envelope on every outcome, usage
errors in one line, a dry run that refuses what the real run refuses, help that reads at 80
columns, flags that mean one thing everywhere and can come from the environment.

Most tests run the real entry point in-process (`ckptctl.cli.run`, what `main()` runs: Typer in
standalone_mode=False, so parse errors come back to us); a few run the installed script.
"""

from __future__ import annotations

import json
import re
import shutil
import unicodedata
from pathlib import Path

import pytest
from conftest import run_script
from fake_server import Behaviour, FakeServer
from metas_samples import write_small_metas

from ckptctl.cli import COMMANDS, run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-checkpoint"


pytestmark = pytest.mark.usefixtures("plain_process")


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_document(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one JSON document on stdout, got {stdout!r}"
    return json.loads(lines[0])


def dry(*args: str) -> list[str]:
    return ["update", "--dry-run", "--checkpoint-path", str(TINY), *args]


# -- item 2: one envelope on every outcome ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (dry("--world-size", "two", "--json"), "--world-size takes a whole number, not 'two'"),
        (["inspect-metas", "--json"], "name one metas file: FILE, or --load-metas-file FILE"),
        (dry("--split", "bytes", "--json"), "--split takes one of auto, files, tensors"),
        (["update", "--bogus", "--json"], "no such option --bogus"),
        (["wait-ready", "--interval", "0", "--json"], "--interval must be at least 0.01"),
        # (not a number: it passed every bound and hung, or ended in an internal error)
        (["wait-ready", "--timeout", "nan", "--json"], "--timeout must be a finite number"),
        (["wait-ready", "--interval", "nan", "--json"], "--interval must be a finite number"),
        (["doctor", "--timeout", "nan", "--json"], "--timeout must be a finite number"),
        (["status", "--wait", "nan", "--json"], "--wait must be a finite number"),
        (["stop", "--timeout", "inf", "--json"], "--timeout must be a finite number, not inf"),
        (dry("--bucket-size-gb", "nan", "--json"), "--bucket-size-gb must be a finite number"),
        (["doctor", "--pause", "retract", "--json"], "--pause asks the servers"),
        (["wait-ready", "--endpoint", "http://x:99999", "--json"], "port is not a number"),
        (dry("--endpoint", "http://x:99999", "--json"), "port is not a number from 1 to 65535"),
        (dry("--endpoint", "http://x:0", "--json"), "port is not a number from 1 to 65535"),
    ],
)
def test_usage_errors_write_the_failure_envelope(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    code, out, err = cli(capsys, *args)
    assert code == 2
    doc = one_document(out)
    assert doc == {"ok": False, "exit_code": 2, "error": doc["error"]}
    assert words in doc["error"]
    assert err.splitlines() == [f"error: {doc['error']}"]  # the same one line on stderr


def test_usage_error_on_another_rank_writes_nothing_on_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = cli(capsys, *dry("--world-size", "two", "--json"))
    assert code == 2 and out == ""
    assert err.startswith("[rank 1] error: --world-size takes a whole number")


def test_a_dry_run_is_a_successful_envelope(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(
        capsys, *dry("--world-size", "2", "--inference-parallel-size", "2", "--json")
    )
    assert code == 0
    doc = one_document(out)
    assert (doc["ok"], doc["exit_code"], doc["error"]) == (True, 0, None)
    assert list(doc)[:3] == ["ok", "exit_code", "error"]
    # tensors is always a list of names; a count is tensor_count
    assert doc["tensor_count"] == 25 and "total_tensors" not in doc
    assert all(isinstance(r["tensors"], list) for r in doc["ranks"])
    assert sum(r["tensor_count"] for r in doc["ranks"]) == 25


def test_wait_ready_timeout_keeps_its_fields_in_the_envelope(
    capsys: pytest.CaptureFixture[str], refused_endpoint: str
) -> None:
    code, out, _ = cli(
        capsys,
        "wait-ready",
        "--endpoint",
        refused_endpoint,
        "--timeout",
        "0",
        "--json",
    )
    assert code == 4
    doc = one_document(out)
    assert doc["ok"] is False and doc["exit_code"] == 4 and "was not listening" in doc["error"]
    assert doc["ready"] is False and doc["attempts"] >= 1 and "elapsed_s" in doc


def test_wait_ready_success_is_an_envelope(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(Behaviour()) as s:
        code, out, _ = cli(capsys, "wait-ready", "--endpoint", s.endpoint, "--json")
    assert code == 0
    doc = one_document(out)
    assert (doc["ok"], doc["exit_code"], doc["error"], doc["ready"]) == (True, 0, None, True)


def test_inspect_metas_mismatch_is_a_failure_with_the_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metas = write_small_metas(tmp_path)
    code, out, err = cli(
        capsys, "inspect-metas", str(metas), "--checkpoint-path", str(TINY), "--json"
    )
    assert code == 1
    doc = one_document(out)
    assert doc["ok"] is False and doc["exit_code"] == 1 and "difference(s)" in doc["error"]
    assert doc["checkpoint_name"] == "ck-iter-7" and doc["check"]["ok"] is False
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_inspect_metas_match_is_a_success(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metas = write_small_metas(tmp_path)
    code, out, _ = cli(capsys, "inspect-metas", str(metas), "--json")
    assert code == 0 and one_document(out)["ok"] is True


def test_a_failed_command_as_the_installed_script() -> None:
    r = run_script(*dry("--world-size", "two", "--json"))
    assert r.returncode == 2
    assert one_document(r.stdout)["exit_code"] == 2
    assert len(r.stderr.splitlines()) == 1


# -- item 3: usage errors are one line, in our words ---------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            dry("--world-size", "two"),
            "error: --world-size takes a whole number, not 'two' (see ckptctl update --help)",
        ),
        (
            dry("--world-size=0"),
            "error: --world-size must be at least 1, not 0 (see ckptctl update --help)",
        ),
        (
            dry("--split", "bytes"),
            "error: --split takes one of auto, files, tensors, not 'bytes' "
            "(see ckptctl update --help)",
        ),
        (
            ["wait-ready", "--timeout", "soon"],
            "error: --timeout takes a number, not 'soon' (see ckptctl wait-ready --help)",
        ),
        (["update", "--bogus"], "error: no such option --bogus (see ckptctl update --help)"),
        (
            ["update", "--endpont", "x"],
            "error: no such option --endpont; did you mean --endpoint? (see ckptctl update --help)",
        ),
        (["save-metas", "--checkpoint-path", "x"], None),  # --save-metas-file is required
        (["update", "--endpoint"], "error: --endpoint needs a value (see ckptctl update --help)"),
        (["inspect-metas"], "error: name one metas file: FILE, or --load-metas-file FILE"),
        (["updat"], "error: no such command 'updat'; did you mean update? (see ckptctl --help)"),
        (
            ["serve", "--register-mode", "engine", "--drop-page-cache", "--endpoint", "http://h"],
            "error: --drop-page-cache needs --register-mode direct (checkpoint-engine's copy "
            "reads through the file mapping)",
        ),
    ],
)
def test_usage_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], line: str | None
) -> None:
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    if line is not None:
        assert lines[0] == line
    for typer_words in ("Input should be", "Value error", "Possible options", "╭", "Usage:"):
        assert typer_words not in err


def test_no_arguments_show_the_overview_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys)
    assert code == 2 and "update" in out and "Usage" in out


# -- item 5: the dry run refuses what the real run refuses ---------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--world-size", "8", "--inference-parallel-size", "3"],
            "--inference-parallel-size 3 does not divide the world size 8",
        ),
        (
            ["--world-size", "8", *("--endpoint", "http://a:1", "--endpoint", "http://a:2")]
            + ["--endpoint", "http://a:3"],
            "--endpoint was given 3 times but this node leads 1 server group(s)",
        ),
        (
            ["--world-size", "8", "--inference-parallel-size", "2"],
            "makes 4 server groups on this node, but --endpoint names 1 server(s)",
        ),
        (
            ["--world-size", "2", "--inference-parallel-size", "2", "--consume-shm-files"],
            "--consume-shm-files pins and deletes files under /dev/shm only",
        ),
        (
            ["--world-size", "2", "--inference-parallel-size", "2", "--endpoint", "localhost:1"],
            "is not an http(s) URL",
        ),
        (
            ["--world-size", "2", "--inference-parallel-size", "2", "--engine", "vllm"]
            + ["--weight-version", "v1"],
            "vLLM records no weight version",
        ),
        (["--world-size", "8", "--nproc-per-node", "3"], "--nproc-per-node 3 does not divide"),
    ],
)
def test_dry_run_refuses_what_the_real_run_refuses(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    code, out, err = cli(capsys, *dry(*args, "--json"))
    assert code == 2, err
    assert words in one_document(out)["error"]


def test_dry_run_refuses_consuming_with_a_tensor_split_and_consumes_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shm = Path("/dev/shm") / f"ckptctl-test-dry-consume-{id(capsys)}"
    shutil.copytree(TINY, shm)
    try:
        base = ["update", "--dry-run", "--checkpoint-path", str(shm), "--world-size", "2"]
        base += ["--inference-parallel-size", "2", "--consume-shm-files"]
        code, _, err = cli(capsys, *base, "--split", "tensors")
        assert code == 2 and "use --split files" in err
        code, out, err = cli(capsys, *base, "--json")  # files: the plan, and the files stay
        assert code == 0, err
        assert json.loads(out)["split"] == "files"
        assert sorted(p.name for p in shm.iterdir()) == sorted(p.name for p in TINY.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_dry_run_shows_which_group_feeds_which_server(capsys: pytest.CaptureFixture[str]) -> None:
    servers = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    args = dry("--world-size", "16", "--nproc-per-node", "8", "--inference-parallel-size", "4")
    args += ["--endpoint", servers[0], "--endpoint", servers[1]]
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    groups = one_document(out)["groups"]
    assert [(g["group"], g["leader"], g["node"], g["endpoint"]) for g in groups] == [
        (0, 0, 0, servers[0]),
        (1, 4, 0, servers[1]),
        (2, 8, 1, servers[0]),
        (3, 12, 1, servers[1]),
    ]
    assert groups[1]["ranks"] == [4, 5, 6, 7] and groups[0]["uds"] is None
    code, out, _ = cli(capsys, *args)  # the table
    assert code == 0
    rows = [line for line in out.splitlines() if servers[1] in line]
    assert len(rows) == 2 and "4-7" in rows[0] and "12-15" in rows[1]


def test_dry_run_hints_at_nproc_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, *dry("--world-size", "8", "--inference-parallel-size", "4"))
    assert code == 2 and "give --nproc-per-node" in err and "took 8 ranks per node" in err
    ok, _, _ = cli(
        capsys, *dry("--world-size", "8", "--inference-parallel-size", "4"), "--nproc-per-node", "4"
    )
    assert ok == 0


def test_dry_run_only_flags_are_refused_in_a_real_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "update", "--checkpoint-path", str(TINY), "--nproc-per-node", "2")
    assert code == 2 and "--nproc-per-node only goes with --dry-run" in err


# -- item 8: --help at 80 columns ---------------------------------------------------------------

LABELS = re.compile(r"<(bool|list\[[^>]*\]|int|float|str|int range|float range)>|\[x[<>]=|<=x")
OWN_HELP = list(COMMANDS)


def cells(line: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in line)


@pytest.mark.parametrize("command", ["", *OWN_HELP])
def test_help_reads_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    code, out, _ = cli(capsys, *([command] if command else []), "--help")
    assert code == 0
    assert "…" not in out, "a cut flag name or value"
    assert max(cells(line) for line in out.splitlines()) <= 80
    assert "[default: (" not in out
    if command:  # (the root's completion flags are Typer's own)
        assert not LABELS.search(out), LABELS.search(out)
    assert "Exit codes: 0 success" in out


def test_update_help_groups_its_flags_and_shows_examples(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    _, out, _ = cli(capsys, "update", "--help")
    panels = re.findall(r"╭─ (.+?) ─", out)
    assert panels == [
        "Checkpoint",
        "Inference server",
        "Transfer",
        "Verifying what the server holds",
        "Dry run (no GPU, no server, no torchrun)",
        "Output",
    ]
    for flag in ("--inference-parallel-size", "--consume-shm-files", "--nproc-per-node"):
        assert re.search(rf"│ {re.escape(flag)}\s", out), flag
    assert "[default: http://localhost:19730]" in out and "[env var: CKPTCTL_ENDPOINT]" in out
    assert "Examples:" in out and "ckptctl update --dry-run --checkpoint-path DIR" in out


# -- issue 25, item 7: -h short, --help full; examples that paste; help that says it right -------


def _help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    return out


@pytest.mark.parametrize("command", OWN_HELP)
def test_short_help_is_short_and_names_real_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    from ckptctl.cli._help import MAIN_FLAGS

    short = _help(capsys, monkeypatch, command, "-h")
    full = _help(capsys, monkeypatch, command, "--help")
    lines = short.splitlines()
    assert lines[0].startswith(f"Usage: ckptctl {command} ")
    assert len(lines) <= 60 and max(cells(line) for line in lines) <= 80
    assert len(lines) < len(full.splitlines())
    assert "Main options:" in short and f"All options: ckptctl {command} --help" in short
    for flag, _ in MAIN_FLAGS[command]:
        for name in re.findall(r"--?[a-z-]+", flag):
            assert re.search(rf"(│|\s){re.escape(name)}\s", full), (command, name)
            assert name in short


def test_update_short_help_shows_the_defaults_of_its_signature(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    short = _help(capsys, monkeypatch, "update", "-h")
    assert re.search(r"--inference-parallel-size N .*\[default: 8\]", short), short
    assert "[default: http://localhost:19730]" in short and "[default: 600]" in short


@pytest.mark.parametrize("command", ["", *OWN_HELP])
def test_examples_paste_whole_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Every example line shows whole in --help at 80 columns (`update --help` broke
    "--weight-version step-7" over two lines), and each flag it uses is the command's."""
    from ckptctl.cli._help import EXAMPLES, OVERVIEW_EXAMPLES

    out = _help(capsys, monkeypatch, *([command] if command else []), "--help")
    shown = [line.strip() for line in out.splitlines()]
    examples = EXAMPLES[command] if command else OVERVIEW_EXAMPLES
    for line in examples:
        assert line.strip() in shown, line
    joined = " ".join(examples).replace("\\ ", "")
    for name, flags in re.findall(r"ckptctl ([a-z-]+)((?: [^ ]+)*)", joined):
        if name not in COMMANDS:
            continue
        full = _help(capsys, monkeypatch, name, "--help")
        for flag in re.findall(r"(?<!\S)(--[a-z-]+)", flags):
            assert re.search(rf"(│|\s){re.escape(flag)}\s", full), (name, flag)


def test_the_overview_groups_commands_and_shows_examples(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _help(capsys, monkeypatch, "-h")
    assert out == _help(capsys, monkeypatch, "--help")
    assert re.findall(r"╭─ (.+?) ─", out)[1:] == [
        "One-shot: check, then update under torchrun",
        "Resident job: serve under torchrun, then push from the node",
        "Metas files and p2p",
    ]
    assert "Examples:" in out and "ckptctl update -h" in out
    assert "ckptctl --install-completion [bash|zsh|fish]" in out  # (Typer's own say less)
    assert "--help                -h   " in out and "<bool>  Show this message" not in out


def test_help_texts_say_it_right(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    helps = {c: _help(capsys, monkeypatch, c, "--help") for c in OWN_HELP}
    assert "on command ." not in helps["serve"] and "on command." in helps["serve"]
    for command, out in helps.items():
        assert not re.search(r"default: \d+\.0\]", out), command  # 600, not 600.0
    assert re.search(r"--bucket-size-gb +N +", helps["update"]) and "GIB" not in helps["update"]
    metas_file = helps["save-metas"].split("--save-metas-file", 1)[1]
    metas_file = metas_file.split("--checkpoint-name")[0]
    assert "[required]" in metas_file and "│ *  --save-metas-file" in helps["save-metas"]
    assert "--metas-file, works too" in " ".join(metas_file.split())  # its older name, noted


def test_save_metas_names_its_file_as_update_does_and_takes_the_older_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """save-metas names its file --save-metas-file, as `update` does; --metas-file, the CLI
    contract's name, still works (it reaches the checkpoint check: exit 3 for a missing one),
    in every spelling."""
    for flag in (
        ["--save-metas-file", str(tmp_path / "m.json")],
        [f"--save-metas-file={tmp_path}/m"],
        ["--metas-file", str(tmp_path / "m.json")],
        [f"--metas-file={tmp_path}/m"],
    ):
        code, _, err = cli(capsys, "save-metas", "--checkpoint-path", "/nope", *flag)
        assert code == 3 and "/nope: does not exist" in err, err


def test_a_bad_engine_is_said_like_every_other_choice(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = cli(capsys, *dry("--engine", "vlm"))
    assert code == 2
    assert (
        err == "error: --engine takes one of sglang, vllm, not 'vlm' (see ckptctl update --help)\n"
    )
    monkeypatch.setenv("CKPTCTL_ENGINE", "vlm")
    code, _, err = cli(capsys, "wait-ready")
    assert code == 2
    assert err == (
        "error: --engine takes one of sglang, vllm, not 'vlm' (from CKPTCTL_ENGINE) "
        "(see ckptctl wait-ready --help)\n"
    )


# -- items 9 and 10: flags mean one thing; scripts can set them once in the environment -----------


def test_sleep_time_is_seconds_as_a_number_in_update_and_save_metas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = cli(capsys, *dry("--sleep-time", "0.5", "--inference-parallel-size", "1"))
    assert code == 0, err
    for args in (
        dry("--sleep-time", "-1"),
        ["save-metas", "--checkpoint-path", ".", "--sleep-time", "-1"],
    ):
        code, _, err = cli(capsys, *args)
        assert code == 2 and "--sleep-time must be at least 0" in err


def test_a_timeout_that_leaves_no_time_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout 0 was taken, and every job then timed out in its first stage (exit 4)."""
    for args in (
        dry("--timeout", "0"),
        ["save-metas", "--checkpoint-path", ".", "--metas-file", "m.json", "--timeout", "0.5"],
        ["join", "--load-metas-file", "m.json", "--timeout", "0"],
    ):
        code, _, err = cli(capsys, *args)
        assert code == 2 and "--timeout must be at least 1" in err, (args, err)


def test_endpoint_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTCTL_ENDPOINT", "http://127.0.0.1:31001 http://127.0.0.1:31002")
    args = dry("--world-size", "2", "--inference-parallel-size", "1", "--json")
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert [g["endpoint"] for g in one_document(out)["groups"]] == [
        "http://127.0.0.1:31001",
        "http://127.0.0.1:31002",
    ]
    # the flag wins over the environment
    code, out, _ = cli(
        capsys, *args[:-1], "--endpoint", "http://h:1", "--endpoint", "http://h:2", "--json"
    )
    assert [g["endpoint"] for g in one_document(out)["groups"]] == ["http://h:1", "http://h:2"]
    with FakeServer(Behaviour()) as s:
        monkeypatch.setenv("CKPTCTL_ENDPOINT", s.endpoint)
        code, out, _ = cli(capsys, "wait-ready", "--json", "--timeout", "20")
    assert code == 0 and one_document(out)["ready"] is True
    # The list that update takes, where one server goes: said so, naming the variable.
    monkeypatch.setenv("CKPTCTL_ENDPOINT", "http://127.0.0.1:31001 http://127.0.0.1:31002")
    code, _, err = cli(capsys, "wait-ready", "--timeout", "1")
    assert code == 2 and "(from CKPTCTL_ENDPOINT) is 2 URLs where one server goes" in err, err


def test_zsh_completion_starts_with_compdef() -> None:
    first = (ROOT / "completions" / "ckptctl.zsh").read_text().splitlines()[0]
    assert first == "#compdef ckptctl"  # zsh loads a completion file only when line 1 says so
    for shell in ("bash", "fish"):
        assert (ROOT / "completions" / f"ckptctl.{shell}").read_text().strip()


@pytest.mark.no_cuda
def test_gpu_commands_without_a_gpu_advise_only_what_exists(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # (a torchrun rank of a world of 1: the job leaves the test process's environment alone)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    args = ["--checkpoint-path", str(TINY), "--metas-file", str(tmp_path / "m.json")]
    code, _, err = cli(capsys, "save-metas", *args, "--timeout", "30")
    assert code == 1 and "no CUDA device" in err
    assert "ckptctl update --dry-run" in err and "(use --dry-run" not in err
