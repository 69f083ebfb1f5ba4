"""`ckptctl doctor` (issue 28, item 4): one line per check with its fix, `--json` for scripts,
exit 0 only when every needed check passes. Run as the installed script on this machine (no
CUDA here: the CUDA check fails), against real loopback servers that answer like SGLang and
vLLM (tests/fake_server.py, with tests/fake_checker.py's weights checker), a server that is
down, one that is neither, one that never answers, and under lowered limits.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import resource
import sys
from pathlib import Path

import pytest
from conftest import run_script
from fake_server import Behaviour, FakeServer

from ckptctl import doctor
from ckptctl.ce import internals as ce_internals
from ckptctl.cli import run

MACHINE = ["cuda", "checkpoint-engine", "torchrun", "memlock", "open-files", "dev-shm", "rdma"]
STATUSES = ("ok", "warn", "fail")


pytestmark = pytest.mark.usefixtures("plain_process")


def _document(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON document on stdout, got {stdout!r}"
    doc = json.loads(lines[0])
    for check in doc["checks"]:
        assert check["status"] in STATUSES, check
        assert check["detail"], check
        assert (check["fix"] is None) == (check["status"] == "ok"), check  # a fix where needed
        assert check["status"] != "fail" or check["needed"], check  # advisory ones only warn
    failed = [c["name"] for c in doc["checks"] if c["status"] == "fail"]
    assert doc["failed"] == failed
    assert doc["ok"] is (not failed) and doc["exit_code"] == (1 if failed else 0)
    return doc


def _by_name(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for check in doc["checks"]:
        out.setdefault(check["name"], []).append(check)
    return out


def _doctor_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    """In-process, as `main()` runs it."""
    code = run(["doctor", *args, "--json"])
    out, _ = capsys.readouterr()
    return code, _document(out)


# -- this machine ------------------------------------------------------------------------------


@pytest.mark.no_cuda
def test_without_cuda_the_cuda_check_fails_with_its_fix_and_exit_1() -> None:
    r = run_script("doctor")
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    cuda = next(i for i, line in enumerate(lines) if line.split()[1:2] == ["cuda"])
    assert lines[cuda].split()[0] == "fail" and "without CUDA" in lines[cuda]
    assert lines[cuda + 1].split()[0] == "fix:" and "CUDA build of torch" in lines[cuda + 1]
    # Every line is a check (status, name, detail) or the fix of the one above it.
    names = [line.split()[1] for line in lines if not line.startswith(" ")]
    assert names == MACHINE
    assert all(line.split()[0] in STATUSES for line in lines if not line.startswith(" "))
    assert all(line.split()[0] == "fix:" for line in lines if line.startswith(" "))
    assert "\x1b[" not in r.stdout  # not a terminal: no styles
    # The one error line names what failed; no traceback.
    assert r.stderr.strip().splitlines() == [
        next(line for line in r.stderr.splitlines() if line.startswith("error: "))
    ]
    assert "1 needed check failed (cuda)" in r.stderr
    ce = next(line for line in lines if line.split()[1:2] == ["checkpoint-engine"])
    assert ce.split()[:3] == ["ok", "checkpoint-engine", ce_internals.installed_version()]


@pytest.mark.no_cuda
def test_quiet_shows_only_what_warns_or_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["doctor", "-q"])
    out, err = capsys.readouterr()
    assert code == 1, err
    checks = [line.split() for line in out.splitlines() if not line.startswith(" ")]
    assert ["fail", "cuda"] in [c[:2] for c in checks]  # (no CUDA here)
    assert checks and all(c[0] in ("warn", "fail") for c in checks), out
    assert "1 needed check failed (cuda)" in err


def _lower_open_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


@pytest.mark.no_cuda
def test_json_under_a_low_open_files_limit_and_an_old_checkpoint_engine(tmp_path: Path) -> None:
    """One run (each costs a torch import): `ulimit -n 256` set for it by preexec, and a real
    distribution's metadata, older than ckptctl was written for, first on its path."""
    info = tmp_path / "checkpoint_engine-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: checkpoint-engine\nVersion: 0.3.1\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    r = run_script("doctor", "--json", env={"PYTHONPATH": path}, preexec_fn=_lower_open_files)
    assert r.returncode == 1, r.stderr
    doc = _document(r.stdout)
    assert [c["name"] for c in doc["checks"]] == MACHINE
    assert doc["error"].startswith("2 needed checks failed (cuda, checkpoint-engine)")
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["cuda"]["status"] == "fail"
    ce = checks["checkpoint-engine"]
    assert ce["status"] == "fail" and ce["version"] == "0.3.1"
    assert "0.3.1" in ce["detail"] and ce_internals.WRITTEN_FOR in ce["detail"]
    assert ce["fix"] == f"pip install 'checkpoint-engine{ce_internals.WRITTEN_FOR}'"
    # The lowered limit warns, and does not fail the run.
    files = checks["open-files"]
    assert files["status"] == "warn" and files["soft_limit"] == 256
    assert "ulimit -n 256" in files["detail"] and files["fix"].startswith("ulimit -n ")
    shm = os.statvfs("/dev/shm")
    assert checks["dev-shm"]["bytes"] == shm.f_blocks * shm.f_frsize
    assert not checks["rdma"]["needed"] and not checks["memlock"]["needed"]


def test_this_processes_limits_and_installed_checkpoint_engine_pass() -> None:
    """The same checks, here, unlowered: what the run above changed is what it reported."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < doctor.OPEN_FILES_WANTED <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (doctor.OPEN_FILES_WANTED, hard))
    try:
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= doctor.OPEN_FILES_WANTED:
            assert doctor.check_open_files().status == "ok"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    ce = doctor.check_checkpoint_engine()
    assert ce.status == "ok" and ce.extra["version"] == ce_internals.installed_version()
    assert ce_internals.installed_version() == importlib.metadata.version("checkpoint-engine")
    assert ce_internals.version_problem() is None


def test_a_torchrun_of_another_python_warns(tmp_path: Path) -> None:
    """The script torchrun on PATH would run: this Python's, or another's (its #! line)."""
    other = tmp_path / "torchrun"
    other.write_text("#!/usr/bin/python3\nimport sys\n")
    check = doctor.check_torchrun(lambda name: str(other))
    assert check.status == "warn" and "/usr/bin/python3, not this Python" in check.detail
    assert check.fix and sys.executable in check.fix
    mine = tmp_path / "mine"
    mine.write_text(f"#!{Path(sys.executable).parent / 'python'}\n")
    assert doctor.check_torchrun(lambda name: str(mine)).status == "ok"
    assert doctor.check_torchrun(lambda name: None).status == "warn"  # none on PATH


def test_rdma_devices_are_read_from_sysfs(tmp_path: Path) -> None:
    for dev, state in (("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")):
        port = tmp_path / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
    check = doctor.check_rdma(str(tmp_path))
    assert [d["name"] for d in check.extra["devices"]] == ["mlx5_0", "mlx5_1"]
    assert [d["active"] for d in check.extra["devices"]] == [True, False]
    assert "mlx5_0, mlx5_1 (no active port)" in check.detail
    assert check.status in ("ok", "warn") and not check.needed
    none = doctor.check_rdma(str(tmp_path / "absent"))
    assert none.status == "warn" and "no RDMA devices" in none.detail and none.fix


# -- servers -----------------------------------------------------------------------------------


def test_servers_sglang_vllm_and_one_down_in_one_run(refused_endpoint: str) -> None:
    """--endpoint repeats: each server gets its line, and its weights checker one."""
    with (
        FakeServer(Behaviour(profile="sglang-0.5.23")) as sglang,
        FakeServer(Behaviour(profile="vllm")) as vllm,
    ):
        r = run_script(
            "doctor", "--json", "--timeout", "30",
            "--endpoint", sglang.endpoint, "--endpoint", vllm.endpoint,
            "--endpoint", refused_endpoint,
        )  # fmt: skip
    assert r.returncode == 1, r.stderr
    doc = _document(r.stdout)
    servers = _by_name(doc)["server"]
    assert [s["endpoint"] for s in servers] == [sglang.endpoint, vllm.endpoint, refused_endpoint]
    assert [s.get("engine") for s in servers] == ["sglang", "vllm", None]
    assert servers[0]["status"] == "ok" and "weight version 'default'" in servers[0]["detail"]
    assert "waits for its first weights" in servers[0]["detail"]  # 0.5.23's /ping 503
    assert servers[1]["status"] == "ok" and "--engine vllm" in servers[1]["detail"]
    assert servers[2]["status"] == "fail" and "connection refused" in servers[2]["detail"]
    assert servers[2]["fix"].startswith("start the server")
    checkers = _by_name(doc)["weights-checker"]  # none for the server that is down
    assert [c["endpoint"] for c in checkers] == [sglang.endpoint, vllm.endpoint]
    assert checkers[0]["status"] == "ok" and checkers[0]["actions"] == ["checksum", "compare"]
    assert checkers[1]["status"] == "warn" and checkers[1]["actions"] == []
    assert "server" in doc["failed"] and "weights-checker" not in doc["failed"]
    # The vLLM-like server was asked whether it has the dev-mode route, with nothing to run.
    assert vllm.behaviour.statuses("/collective_rpc") == [400]


@pytest.mark.parametrize(
    ("profile", "status", "actions"),
    [
        ("sglang-pr17009", "ok", ["compare_checksum", "checksum", "compare"]),
        ("sglang-0.5.14", "ok", ["checksum", "compare"]),
        ("sglang-0.5.9", "warn", ["compare"]),
        ("sglang-0.5.4", "warn", []),
    ],
)
def test_what_each_sglang_weights_checker_offers(
    capsys: pytest.CaptureFixture[str], profile: str, status: str, actions: list[str]
) -> None:
    with FakeServer(Behaviour(profile=profile, weights_loaded=True)) as s:
        _, doc = _doctor_json(capsys, "--endpoint", s.endpoint)
        seen = s.behaviour.requests
    server = _by_name(doc)["server"][0]
    assert server["status"] == "ok" and server["engine"] == "sglang"
    checker = _by_name(doc)["weights-checker"][0]
    assert checker["status"] == status and checker["actions"] == actions
    # Asking changed nothing: no snapshot, no reset, no update.
    asked = [json.loads(r["body"] or b"{}").get("action") for r in seen if r["method"] == "POST"]
    assert set(asked) <= {"compare_checksum", "checksum"}, asked


def test_pause_asks_each_server_for_the_mode_without_pausing_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """doctor --pause MODE: each server's version and routes for the mode, asked with GETs only
    (SGLang answers 405 on a POST-only route it has); a version that cannot honour it, or a
    server of the other kind, fails the check."""
    with (
        FakeServer(Behaviour(weights_loaded=True)) as new,
        FakeServer(Behaviour(profile="sglang-0.5.9", weights_loaded=True)) as old,
        FakeServer(Behaviour(profile="vllm")) as vllm,
    ):
        servers = (new, old, vllm)
        endpoints = [a for s in servers for a in ("--endpoint", s.endpoint)]
        code, doc = _doctor_json(capsys, *endpoints, "--pause", "retract")
        pause = _by_name(doc)["pause"]
        assert [c["status"] for c in pause] == ["ok", "fail", "fail"], pause
        assert "--pause retract works" in pause[0]["detail"]
        assert "sglang 0.5.9 deadlocks an IPC update" in pause[1]["detail"]
        assert "whose pause modes are none, abort, wait, keep" in pause[2]["detail"]
        assert code == 1 and "pause" in doc["failed"]
        _, doc = _doctor_json(capsys, "--endpoint", vllm.endpoint, "--pause", "keep")
        assert _by_name(doc)["pause"][0]["status"] == "ok"
        for s in servers:
            assert not s.behaviour.generations().snapshot()["paused"]
            posted = {
                r["path"].split("?")[0] for r in s.behaviour.requests if r["method"] == "POST"
            }
            assert not posted & {"/pause_generation", "/continue_generation", "/pause", "/resume"}


def test_an_api_key_the_server_wants(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(Behaviour(profile="sglang-0.5.14", api_key="sekrit-key-123")) as s:
        _, without = _doctor_json(capsys, "--endpoint", s.endpoint)
        _, with_key = _doctor_json(capsys, "--endpoint", s.endpoint, "--api-key", "sekrit-key-123")
    server = _by_name(without)["server"][0]
    assert server["status"] == "fail" and "refused the API key" in server["detail"]
    assert "--api-key" in server["fix"]
    assert _by_name(with_key)["server"][0]["status"] == "ok"
    assert _by_name(with_key)["weights-checker"][0]["actions"] == ["checksum", "compare"]
    assert "sekrit-key-123" not in json.dumps(with_key)


def test_a_server_that_is_neither(capsys: pytest.CaptureFixture[str], http_server: str) -> None:
    code, doc = _doctor_json(capsys, "--endpoint", http_server)
    assert code == 1
    server = _by_name(doc)["server"][0]
    assert server["status"] == "fail" and "neither SGLang nor vLLM" in server["detail"]
    assert "weights-checker" not in _by_name(doc)


def test_a_server_that_never_answers_is_a_failed_check(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(Behaviour(mode="hang")) as s:
        code, doc = _doctor_json(capsys, "--endpoint", s.endpoint, "--timeout", "0.5")
    assert code == 1
    server = _by_name(doc)["server"][0]
    assert server["status"] == "fail" and "no answer within" in server["detail"]


def test_a_server_socket_of_another_user_is_a_failed_check_and_the_report_goes_on(
    capsys: pytest.CaptureFixture[str], short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--uds naming a socket whose owner is neither this user nor root (here: this user's
    uid is taken as no trusted one): one failed check with its fix, beside every other check,
    never the whole report ended in one error line; nothing is sent to it."""
    import ckptctl.bounded_http

    monkeypatch.setattr(ckptctl.bounded_http, "server_uids", lambda: frozenset({os.getuid() + 1}))
    with FakeServer(Behaviour(profile="sglang-0.5.14"), uds=str(short_tmp / "sglang.sock")) as s:
        code, doc = _doctor_json(capsys, "--uds", s.uds)
        assert s.behaviour.requests == []
    assert code == 1
    assert [c["name"] for c in doc["checks"]] == [*MACHINE, "server"]
    server = _by_name(doc)["server"][0]
    assert server["status"] == "fail" and server["uds"] == s.uds
    assert f"belongs to uid {os.getuid()}, not to uid [{os.getuid() + 1}]" in server["detail"]
    assert "--uds" in server["fix"]


UNPAIRED = ["--uds", "/a", "--uds", "/b", *("--endpoint", "http://a") * 3]


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--endpoint", "ftp://example"], 2, "is not an http(s) URL"),
        (["--endpoint", "localhost:19730"], 2, "is not an http(s) URL"),
        (UNPAIRED, 2, "--uds 2 times"),
        (["--timeout", "0"], 2, "--timeout must be at least 0.1"),
    ],
)
def test_bad_input_is_one_error_line(
    capsys: pytest.CaptureFixture[str], args: list[str], code: int, words: str
) -> None:
    assert run(["doctor", *args]) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and words in err, err
    assert run(["doctor", *args, "--json"]) == code
    out, _ = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == code and words in doc["error"]
