"""The HTTP half of --pause (ckptctl/server_pause.py) against the stand-in servers on loopback:
what each engine is sent (SGLang a JSON body, vLLM a query string), which versions are refused
for which mode and why, what flush_cache the update asks for, and the resume's retries. Nothing
here depends on time: the stand-in's generations are steered by the test."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from fake_server import Behaviour, FakeServer

from ckptctl import server_pause
from ckptctl.errors import DeadlineExceeded, OperationFailed
from ckptctl.inference_server import ServerAddress
from ckptctl.settings import PauseMode
from ckptctl.transfer.request import resolve


def address(server: FakeServer, key: str | None = None) -> ServerAddress:
    return ServerAddress(endpoint=server.endpoint, api_key=key)


def sent(server: FakeServer, path: str) -> list[dict]:
    return [r for r in server.behaviour.requests if r["path"].split("?")[0] == path]


@pytest.fixture
def sglang() -> Iterator[FakeServer]:
    with FakeServer(Behaviour(abort_poll_s=0.01)) as s:
        yield s


@pytest.fixture
def vllm() -> Iterator[FakeServer]:
    with FakeServer(Behaviour(profile="vllm")) as s:
        yield s


@pytest.mark.parametrize(
    ("engine", "mode", "version", "refused_because"),
    [
        ("sglang", PauseMode.abort, "0.4.8", "has no /pause_generation"),
        ("sglang", PauseMode.abort, "0.5.4", None),
        ("sglang", PauseMode.abort, None, None),  # a missing route answers 404 itself
        ("sglang", PauseMode.retract, "0.5.5.post3", "takes any mode and aborts"),
        ("sglang", PauseMode.in_place, "0.5.10", "deadlocks an IPC update"),
        ("sglang", PauseMode.retract, "0.5.11", None),
        ("sglang", PauseMode.in_place, "0.5.23", None),
        ("sglang", PauseMode.retract, "main", "reports no version ckptctl can read"),
        ("sglang", PauseMode.in_place, None, "reports no version"),
        ("vllm", PauseMode.abort, "0.11.2", "has no /pause"),
        ("vllm", PauseMode.abort, "0.12.0", None),
        ("vllm", PauseMode.keep, "0.15.0", "ignores mode= and aborts"),
        ("vllm", PauseMode.wait, "0.16.0", None),
        ("vllm", PauseMode.keep, "0.34.0+cu128", None),
        ("vllm", PauseMode.keep, "0.11.1.dev345+gabc", "has no /pause"),
    ],
)
def test_each_mode_is_refused_on_the_versions_that_would_not_honour_it(
    engine: str, mode: PauseMode, version: str | None, refused_because: str | None
) -> None:
    problem = server_pause.version_problem(engine, mode, version)
    if refused_because is None:
        assert problem is None
    else:
        assert problem is not None and refused_because in problem


@pytest.mark.parametrize(
    ("engine", "mode", "version", "flush"),
    [
        ("sglang", PauseMode.none, "0.5.23", True),
        ("sglang", PauseMode.abort, "0.5.15", True),
        ("sglang", PauseMode.in_place, "0.5.23", False),  # held requests refuse the flush
        ("sglang", PauseMode.retract, "0.5.15", False),  # queued ones refuse it on 0.5.10-0.5.20
        ("sglang", PauseMode.retract, "0.5.21", True),
        ("vllm", PauseMode.keep, "0.34.0", True),  # (vLLM's update has no such flag)
    ],
)
def test_the_update_asks_for_a_cache_flush_only_where_the_server_can_do_it(
    engine: str, mode: PauseMode, version: str, flush: bool
) -> None:
    assert server_pause.flush_cache(engine, mode, version) is flush


def test_sglang_is_paused_with_a_json_body_and_resumed_with_an_empty_object(
    sglang: FakeServer,
) -> None:
    assert server_pause.read_version(address(sglang), "sglang") == "0.5.23"
    server_pause.pause(address(sglang), "sglang", PauseMode.retract, timeout=10)
    assert json.loads(sent(sglang, "/pause_generation")[0]["body"]) == {"mode": "retract"}
    assert sglang.behaviour.generations().snapshot()["held_mode"] == "retract"
    assert server_pause.resume(address(sglang), "sglang", budget_s=10) == 1
    assert json.loads(sent(sglang, "/continue_generation")[0]["body"]) == {}
    assert not sglang.behaviour.generations().snapshot()["paused"]


def test_vllm_is_paused_through_the_query_string_with_no_body(vllm: FakeServer) -> None:
    assert server_pause.read_version(address(vllm), "vllm") == "0.34.0"
    server_pause.pause(address(vllm), "vllm", PauseMode.keep, timeout=10)
    (request,) = sent(vllm, "/pause")
    assert request["path"] == "/pause?mode=keep" and request["body"] == b""
    assert httpx.get(f"{vllm.endpoint}/is_paused").json() == {"is_paused": True}
    server_pause.resume(address(vllm), "vllm", budget_s=10)
    assert httpx.get(f"{vllm.endpoint}/is_paused").json() == {"is_paused": False}


def test_an_abort_pause_answers_once_the_generations_in_flight_have_ended(
    sglang: FakeServer,
) -> None:
    gen = sglang.behaviour.generations()
    sglang.behaviour.token_delay_s = 0.01
    answers: list[dict] = []

    def generate() -> None:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}
        answers.append(httpx.post(f"{sglang.endpoint}/generate", json=body, timeout=60).json())

    threads = [threading.Thread(target=generate) for _ in range(3)]
    for t in threads:
        t.start()
    while gen.snapshot()["running"] < 3:
        threading.Event().wait(0.01)
    server_pause.pause(address(sglang), "sglang", PauseMode.abort, timeout=30)
    # Answered only once none runs: every generation came back first, cut short.
    (pause,) = sent(sglang, "/pause_generation")
    generations = sent(sglang, "/generate")
    assert all(g["answered"] < pause["answered"] for g in generations)
    assert gen.snapshot()["aborted"] == 3 and gen.snapshot()["running"] == 0
    for t in threads:
        t.join()
    assert {a["meta_info"]["finish_reason"]["type"] for a in answers} == {"abort"}
    server_pause.resume(address(sglang), "sglang", budget_s=10)


@pytest.mark.parametrize(
    ("mode", "said"), [("http500", "refused the pause (--pause in_place): HTTP 500"),
                       ("echo_headers", "refused the pause (--pause in_place): HTTP 400"),
                       ("reset", "the pause of")],
)  # fmt: skip
def test_a_pause_refused_or_broken_off_names_the_server_and_the_mode(
    sglang: FakeServer, mode: str, said: str
) -> None:
    sglang.behaviour.mode, sglang.behaviour.mode_paths = mode, ("/pause_generation",)
    with pytest.raises(OperationFailed) as info:
        server_pause.pause(address(sglang), "sglang", PauseMode.in_place, timeout=10)
    assert sglang.endpoint in str(info.value) and said in str(info.value)


def test_a_pause_route_a_server_lacks_is_a_refusal_that_says_so() -> None:
    with (
        FakeServer(Behaviour(profile="vllm", version="0.11.0")) as s,
        pytest.raises(OperationFailed) as info,
    ):
        server_pause.pause(address(s), "vllm", PauseMode.abort, timeout=10)
    assert "HTTP 404 on /pause" in str(info.value) and "VLLM_SERVER_DEV_MODE=1" in str(info.value)


def test_a_pause_that_gets_no_answer_in_time_is_exit_4(sglang: FakeServer) -> None:
    sglang.behaviour.mode, sglang.behaviour.mode_paths = "hang", ("/pause_generation",)
    with pytest.raises(DeadlineExceeded) as info:
        server_pause.pause(address(sglang), "sglang", PauseMode.abort, timeout=0.5)
    assert "did not answer the pause" in str(info.value)


def test_the_api_key_goes_with_every_pause_request_and_a_refused_key_says_so() -> None:
    with FakeServer(Behaviour(api_key="sekrit-key")) as s:
        assert server_pause.read_version(address(s, "sekrit-key"), "sglang") == "0.5.23"
        server_pause.pause(address(s, "sekrit-key"), "sglang", PauseMode.in_place, timeout=10)
        server_pause.resume(address(s, "sekrit-key"), "sglang", budget_s=10)
        for request in s.behaviour.requests:
            assert request["headers"].get("Authorization") == "Bearer sekrit-key"
        with pytest.raises(OperationFailed) as info:
            server_pause.pause(address(s), "sglang", PauseMode.in_place, timeout=10)
    assert "refused the API key" in str(info.value)


def test_a_resume_is_retried_on_a_5xx_and_a_broken_connection(sglang: FakeServer) -> None:
    b = sglang.behaviour
    server_pause.pause(address(sglang), "sglang", PauseMode.in_place, timeout=10)
    b.mode, b.mode_paths, b.mode_times = "http500", ("/continue_generation",), 2
    attempts = server_pause.resume(address(sglang), "sglang", budget_s=30, sleep=lambda s: None)
    assert attempts == 3 and b.statuses("/continue_generation") == [500, 500, 200]
    assert not b.generations().snapshot()["paused"]
    b.mode, b.mode_times = "reset", None
    with pytest.raises(server_pause.ResumeFailed) as info:
        server_pause.resume(address(sglang), "sglang", budget_s=30, sleep=lambda s: None)
    assert f"({server_pause.RESUME_ATTEMPTS} attempts)" in str(info.value)


def test_a_resume_the_server_refuses_is_not_asked_again(sglang: FakeServer) -> None:
    b = sglang.behaviour
    b.mode, b.mode_paths = "echo_headers", ("/continue_generation",)  # (a 400)
    with pytest.raises(server_pause.ResumeFailed) as info:
        server_pause.resume(address(sglang), "sglang", budget_s=30, sleep=lambda s: None)
    assert "(1 attempt)" in str(info.value) and len(sent(sglang, "/continue_generation")) == 1


def test_doctor_s_probe_asks_without_pausing(sglang: FakeServer, vllm: FakeServer) -> None:
    said = server_pause.probe_routes(address(sglang), "sglang", PauseMode.retract, 10)
    assert "0.5.23" in said and "--pause retract works" in said
    said = server_pause.probe_routes(address(vllm), "vllm", PauseMode.keep, 10)
    assert "/is_paused" in said
    for server in (sglang, vllm):
        assert not server.behaviour.generations().snapshot()["paused"]
        assert all(r["method"] == "GET" for r in server.behaviour.requests)
    with FakeServer(Behaviour(profile="sglang-0.5.9")) as old:
        with pytest.raises(OperationFailed) as info:
            server_pause.probe_routes(address(old), "sglang", PauseMode.in_place, 10)
        assert "0.5.9" in str(info.value) and "deadlocks" in str(info.value)
        said = server_pause.probe_routes(address(old), "sglang", PauseMode.abort, 10)
        assert "--pause abort works" in said


@pytest.mark.parametrize(
    ("engine", "mode"),
    [("vllm", PauseMode.retract), ("vllm", PauseMode.in_place), ("sglang", PauseMode.keep),
     ("sglang", PauseMode.wait)],
)  # fmt: skip
def test_a_mode_the_server_s_kind_lacks_is_a_usage_error(engine: str, mode: PauseMode) -> None:
    from ckptctl.errors import UsageError

    with pytest.raises(UsageError) as info:
        resolve((None, None, None, engine, 1), checkpoint_path=None, pause=mode)
    assert f"--pause {mode} is not one of {engine}'s pause modes" in str(info.value)
