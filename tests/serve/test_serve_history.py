"""`ckptctl status --history`: the serve job's push log. A real `ckptctl serve` job on CPU
(torchrun, 2 ranks, real HTTP to a fake SGLang; only checkpoint-engine's ParameterServer stood
in) logs a good push, a refused one, a failed one and a restored one with their outcomes, for
the CLI (table and --json) and the Python client; the log's bound is checked on its own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import cpu_serve_job, run_script, wait_for_path
from fake_server import Behaviour, FakeServer
from locations import TINY

from ckptctl import client
from ckptctl.results import outcome
from ckptctl.serve.state import PushLog


def _push(sock: str, path: Path, *args: str) -> int:
    r = run_script(
        "push", "--control-socket", sock, "--checkpoint-path", str(path), "--json", *args,
        timeout=120,
    )  # fmt: skip
    return r.returncode


@pytest.mark.slow
def test_history_lists_each_push_with_its_outcome(short_tmp: Path, tmp_path: Path) -> None:
    import torch
    from ckpt_factory import write_real_checkpoint

    other = write_real_checkpoint(tmp_path / "other", [{"w": torch.ones(3, 5)}])  # not TINY's
    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "60", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        assert _push(sock, TINY, "--weight-version", "v1") == 0
        assert _push(sock, other, "--weight-version", "v2") == 3  # another layout: refused
        s.behaviour.update_status = 400
        s.behaviour.update_message = "busy"
        assert _push(sock, TINY, "--weight-version", "v3") == 1  # the server refuses it
        s.behaviour.update_status = 200
        # The stand-in's workers connect, then one fails: the last whole push goes in again.
        failing = ("--weight-version", "v4", "--checkpoint-name", "x-fail-after-connect")
        assert _push(sock, TINY, *failing) == 1

        r = run_script("status", "--control-socket", sock, "--history", "--json", timeout=30)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        pushes = doc["pushes"]
        assert [p["seq"] for p in pushes] == [1, 2, 3, 4]
        assert [p["outcome"] for p in pushes] == [
            "ok",
            "refused before sending",
            "failed",
            "restored",
        ]
        assert [p["weight_version"] for p in pushes] == ["v1", "v2", "v3", "v4"]
        assert [p["server_weights"] for p in pushes] == ["whole", None, None, "whole"]
        assert [p["exit_code"] for p in pushes] == [0, 3, 1, 1]
        assert pushes[1]["checkpoint_path"] == str(other.resolve())
        assert pushes[0]["checkpoint_path"] == str(TINY.resolve())
        assert pushes[0]["total_bytes"] > 0 and pushes[0]["wall_s"] > 0
        for p in pushes:  # ISO 8601 UTC
            time.strptime(p["finished_at"], "%Y-%m-%dT%H:%M:%SZ")
        assert doc["pushes_run"] == 4 and doc["history_limit"] == 1000
        assert doc["ok"] is True and doc["state"] == "idle"  # the status document around it

        # The Python client's status gives the same log; without history=True, no log.
        assert client.status(control_socket=sock, history=True)["pushes"] == pushes
        assert "pushes" not in client.status(control_socket=sock)

        # Piped: a header and one tab-separated line per push, its values whole (grep finds a
        # path, cut takes a column).
        piped = run_script("status", "--control-socket", sock, "--history", timeout=30)
        assert piped.returncode == 0, piped.stderr
        header, *lines = piped.stdout.splitlines()
        columns = header.split("\t")
        assert columns[:4] == ["seq", "outcome", "weight_version", "checkpoint_path"], header
        got = [dict(zip(columns, line.split("\t"), strict=True)) for line in lines]
        assert [g["outcome"] for g in got] == [p["outcome"] for p in pushes]
        assert [g["checkpoint_path"] for g in got] == [p["checkpoint_path"] for p in pushes]
        assert [g["finished_at"] for g in got] == [p["finished_at"] for p in pushes]
        assert got[1]["server_weights"] == "unchanged" and got[0]["seq"] == "1"

        # On a terminal (Rich's TTY_COMPATIBLE says stdout is one): the table.
        table = run_script(
            "status", "--control-socket", sock, "--history", timeout=30,
            env={"COLUMNS": "200", "TTY_COMPATIBLE": "1"},
        )  # fmt: skip
        assert table.returncode == 0, table.stderr
        rows = [line for line in table.stdout.splitlines()[2:] if line.strip()[:1].isdigit()][:-1]
        assert len(rows) == 4, table.stdout
        for row, word in zip(
            rows, ["ok", "refused before sending", "failed", "restored"], strict=True
        ):
            assert word in row and ("v" + row.split()[0]) in row, table.stdout
        assert "4 command(s) run (pushes, stages, rollbacks), the last 1000 kept" in table.stdout, (
            table.stdout
        )
        plain = run_script("status", "--control-socket", sock, timeout=30)
        assert "refused before sending" not in plain.stdout  # plain status: as before

        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_a_line_break_in_a_folder_name_or_a_version_adds_no_line(
    short_tmp: Path, tmp_path: Path
) -> None:
    """A checkpoint folder and a weight version holding "\\nerror: ..." stay one line wherever a
    person reads them - the push's result, the job's log, `status`, `status --history` - shown
    as \\n; they forge no error line there. --json keeps them exact."""
    import shutil

    folder = Path(shutil.copytree(TINY, tmp_path / "ck\nerror: forged by the path"))
    version = "v1\nerror: forged by the version"
    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "60", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        pushed = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(folder),
            "--weight-version", version, timeout=120,
        )  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        wide = {"COLUMNS": "200"}
        shown = [
            run_script("status", "--control-socket", sock, timeout=30, env=wide).stdout,
            run_script(
                "status", "--control-socket", sock, "--history", timeout=30, env=wide
            ).stdout,
            run_script(
                "status", "--control-socket", sock, "--history", timeout=30,
                env={**wide, "TTY_COMPATIBLE": "1"},
            ).stdout,
        ]  # fmt: skip
        exact = run_script("status", "--control-socket", sock, "--history", "--json", timeout=30)
        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        _, log = job.communicate(timeout=60)
    assert job.returncode == 0, log[-3000:]
    for text in (pushed.stdout, pushed.stderr, *shown, log):
        forged = [line for line in text.splitlines() if line.lstrip().startswith("error:")]
        assert forged == [], text
    assert "ck\\nerror: forged by the path" in pushed.stdout
    assert "ck\\nerror: forged by the path" in log and "v1\\nerror: forged by the version" in log
    assert "v1\\nerror: forged by the version" in shown[0] and "v1\\nerror: forged" in shown[1]
    assert "ck\\nerror: forged by the path" in shown[1]  # piped: the value whole
    assert "v1\\nerror: forged" in shown[2]  # the table
    (entry,) = json.loads(exact.stdout)["pushes"]
    assert entry["weight_version"] == version and entry["checkpoint_path"] == str(folder)


def test_the_push_log_keeps_the_last_pushes_and_counts_them_all() -> None:
    log = PushLog(size=3)
    for seq in range(1, 6):
        log.add({"seq": seq, "ok": True, "exit_code": 0, "server_weights": "whole"})
    doc = log.snapshot()
    assert [p["seq"] for p in doc["pushes"]] == [3, 4, 5]
    assert doc["pushes_run"] == 5 and doc["history_limit"] == 3


def test_outcomes_use_one_word_each() -> None:
    whole, none = "whole", None
    cases = [
        ({"ok": True, "action": "push", "server_weights": whole}, "ok"),
        ({"ok": True, "action": "rollback", "server_weights": whole}, "rolled back"),
        ({"ok": False, "exit_code": 1, "server_weights": whole}, "restored"),
        ({"ok": False, "exit_code": 130, "server_weights": none}, "cancelled"),
        ({"ok": False, "exit_code": 3, "server_weights": none}, "refused before sending"),
        ({"ok": False, "exit_code": 1, "server_weights": "partial"}, "failed"),
        ({"ok": False, "exit_code": 4, "server_weights": none}, "failed"),
    ]
    for result, word in cases:
        assert outcome(result) == word, result


@pytest.mark.parametrize("char", ["é", "\U0001f600", "\x01", '"'])
def test_a_full_log_of_the_longest_entries_fits_in_one_answer(char: str) -> None:
    """Strings are cut by their size as the answer's JSON writes them (an emoji escapes to 12
    bytes, a control character to 6), not by characters: 1000 entries of the longest a push
    takes still fit in one answer of the client's cap."""
    from ckptctl.serve.control_client import MAX_RESPONSE_BYTES

    log = PushLog()
    for seq in range(1, log.size + 2):
        log.add({"seq": seq, "ok": False, "exit_code": 1, "checkpoint_path": char * 4096,
                 "weight_version": char * 1024, "error": char * 100_000})  # fmt: skip
    doc = log.snapshot()
    assert len(doc["pushes"]) == log.size and doc["pushes"][0]["seq"] == 2
    assert len(json.dumps({"ok": True, **doc}).encode()) < MAX_RESPONSE_BYTES / 2
    entry = doc["pushes"][0]
    assert entry["checkpoint_path"].endswith(char + "…") and entry["error"].endswith("…")


def test_what_fits_is_kept_whole() -> None:
    log = PushLog()
    path = "/ckpt/" + "a" * 4000  # a long path, but within the 4096 bytes of its cap
    log.add({"seq": 1, "ok": True, "checkpoint_path": path, "weight_version": "v1"})
    entry = log.snapshot()["pushes"][0]
    assert entry["checkpoint_path"] == path and entry["weight_version"] == "v1"


@pytest.mark.slow
def test_a_push_cancelled_while_it_waits_is_logged_as_cancelled(short_tmp: Path) -> None:
    import threading

    sock = str(short_tmp / "serve.sock")
    release = threading.Event()  # the server holds the first push's update until then
    held = Behaviour(on_update=lambda handles, body: release.wait(60))
    with (
        FakeServer(held) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "60", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        answers: dict[str, dict] = {}

        def push(version: str) -> None:
            answers[version] = client.push(
                TINY, weight_version=version, control_socket=sock, push_id=version, check=False
            )

        threads = [threading.Thread(target=push, args=(v,)) for v in ("slow", "waiting")]
        threads[0].start()
        deadline = time.monotonic() + 60
        while client.status(control_socket=sock)["running"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        threads[1].start()
        while client.status(control_socket=sock)["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.cancel("waiting", control_socket=sock)["cancel"] == "cancelled"
        release.set()
        for t in threads:
            t.join(timeout=120)
        assert answers["slow"]["ok"] and answers["waiting"]["exit_code"] == 130

        pushes = {p["seq"]: p for p in client.status(control_socket=sock, history=True)["pushes"]}
        assert pushes[1]["outcome"] == "ok" and pushes[1]["weight_version"] == "slow"
        assert pushes[2]["outcome"] == "cancelled" and pushes[2]["weight_version"] == "waiting"
        assert pushes[2]["checkpoint_path"] == str(TINY.resolve())
        assert pushes[2]["server_weights"] is None
        client.stop(control_socket=sock, wait=60)
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
