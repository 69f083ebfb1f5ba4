"""The update request against real servers answering like SGLang and vLLM, and what a rank does
when it fails while checkpoint-engine's main thread is stuck (it is, in real life)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from fake_server import Behaviour, FakeServer

from ckptctl.inference_server import ServerAddress, UpdateRefused, push_update

HANDLES = {"GPU-aaaa": "ipc://@checkpoint-engine-GPU-aaaa-0.sock"}


def _push(server: FakeServer, engine: str = "sglang", **kw):  # type: ignore[no-untyped-def]
    address = ServerAddress(
        endpoint=server.endpoint, uds=server.uds, api_key=kw.pop("api_key", None)
    )
    return push_update(
        address,
        engine,
        HANDLES,
        weight_version=kw.pop("weight_version", None),
        timeout=kw.pop("timeout", 5.0),
    )


def test_sglang_success_sends_the_contract_body() -> None:
    with FakeServer(Behaviour()) as s:
        message = _push(s, weight_version="v7")
        body = s.behaviour.requests[-1]["body"]
    assert "Weight version updated to v7" in message
    import json

    doc = json.loads(body)
    assert doc == {"zmq_handles": HANDLES, "flush_cache": True, "weight_version": "v7"}


def test_sglang_refusal_carries_the_servers_message() -> None:
    msg = "Device UUID GPU-x not found in zmq_handles: ['GPU-aaaa']"
    with (
        FakeServer(Behaviour(update_status=400, update_message=msg)) as s,
        pytest.raises(UpdateRefused, match="HTTP 400: Device UUID GPU-x not found"),
    ):
        _push(s)


def test_sglang_200_without_success_true_is_a_failure() -> None:
    with FakeServer(Behaviour()) as s:

        def not_really(handles, body):  # type: ignore[no-untyped-def]
            raise RuntimeError("dp_size must be 1")

        s.behaviour.on_update = not_really
        with pytest.raises(UpdateRefused, match="dp_size must be 1"):
            _push(s)


def test_old_sglang_without_the_endpoint() -> None:
    with (
        FakeServer(Behaviour(profile="vllm")) as s,
        pytest.raises(UpdateRefused, match="SGLang >= 0.5.4"),
    ):
        _push(s, engine="sglang")


def test_vllm_collective_rpc() -> None:
    with FakeServer(Behaviour(profile="vllm")) as s:
        _push(s, engine="vllm")
        import json

        doc = json.loads(s.behaviour.requests[-1]["body"])
    assert doc["method"] == "update_weights_from_ipc" and doc["args"] == [HANDLES]


def test_vllm_without_dev_mode_gets_the_hint() -> None:
    with (
        FakeServer(Behaviour(profile="sglang-0.5.23")) as s,
        pytest.raises(UpdateRefused, match="VLLM_SERVER_DEV_MODE=1"),
    ):
        _push(s, engine="vllm")


def test_vllm_worker_exception_is_a_failure() -> None:
    with FakeServer(Behaviour(profile="vllm")) as s:

        def boom(handles, body):  # type: ignore[no-untyped-def]
            raise KeyError("GPU-bbbb")

        s.behaviour.on_update = boom
        with pytest.raises(UpdateRefused, match="HTTP 500: KeyError"):
            _push(s, engine="vllm")


def test_api_key_refused_says_what_to_do() -> None:
    with FakeServer(Behaviour(api_key="right")) as s:
        with pytest.raises(UpdateRefused, match="CKPTCTL_API_KEY") as info:
            _push(s, api_key="wrong-key")
        assert "wrong-key" not in str(info.value)
        _push(s, api_key="right")


def test_unix_socket(short_tmp: Path) -> None:
    with FakeServer(Behaviour(), uds=str(short_tmp / "s.sock")) as s:
        assert "completed" in _push(s)


def test_timeout_and_refused_connection_raise_http_errors(refused_endpoint: str) -> None:
    with FakeServer(Behaviour(mode="hang")) as s, pytest.raises(httpx.TimeoutException):
        _push(s, timeout=0.5)  # (a hung server: only the timeout can end the request)
    with pytest.raises(httpx.ConnectError):
        push_update(
            ServerAddress(refused_endpoint),
            "sglang",
            HANDLES,
            weight_version=None,
            timeout=2,
        )


# -- a failing request must end the rank even while its main thread is blocked -------------------

_RANK_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from ckptctl.launch import launch_info
    from ckptctl.transfer import stages
    from ckptctl.job.coordination import Watchdog
    from ckptctl.job.groups import ServerTargets, assign_group
    from ckptctl.transfer.stages import ServerRequest

    endpoint, engine, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    # How long the transfer may take to end once the server said done: 15 s in the product,
    # shorter here, where no transfer ever ends (the answer-without-IPC case).
    stages.AFTER_ANSWER_GRACE_S = 1.0
    assignment = assign_group(rank=0, world_size=1, local_world_size=1, parallel_size=1,
                              endpoints=[endpoint], uds=[])
    watchdog = Watchdog(launch_info(), None, timeout_s=timeout).start()
    # No IPC transfer ever finishes here: nobody connects to the (absent) zmq socket.
    request = ServerRequest(assignment, ServerTargets(engine=engine), watchdog,
                            timeout=timeout, transfer_finished=threading.Event().wait)
    # checkpoint-engine runs req_func in a thread and then blocks its main thread on zmq.
    threading.Thread(target=request, args=([("GPU-aaaa", "ipc://@x")],), daemon=True).start()
    time.sleep(3600)
    """
)


def _run_rank(
    endpoint: str, engine: str = "sglang", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    # (No wall-clock bound: the exit code and message say which event ended the rank; the
    # watchdog's --timeout would end it with exit 4 and "timed out".)
    return subprocess.run(
        [sys.executable, "-c", _RANK_SCRIPT, endpoint, engine, str(timeout)],
        capture_output=True,
        text=True,
        timeout=100,
    )


def test_refused_update_ends_a_blocked_rank_with_exit_1_and_the_message() -> None:
    with FakeServer(
        Behaviour(
            update_status=400,
            update_message="IPC weight update failed: ImportError checkpoint_engine",
        )
    ) as s:
        r = _run_rank(s.endpoint)
    assert r.returncode == 1, r.stderr
    assert "refused the update: HTTP 400: IPC weight update failed: ImportError" in r.stderr
    assert "Traceback" not in r.stderr


def test_server_down_ends_a_blocked_rank(refused_endpoint: str) -> None:
    r = _run_rank(refused_endpoint)
    assert r.returncode == 1 and "connection refused" in r.stderr


def test_server_that_answers_success_without_connecting_is_caught() -> None:
    # The "answers 200 without ever connecting to the IPC socket" case that hangs the seed script.
    with FakeServer(Behaviour()) as s:
        r = _run_rank(s.endpoint)
    assert r.returncode == 1
    assert "never took the weights over IPC" in r.stderr
    assert [q["status"] for q in s.behaviour.requests] == [200]  # it did answer success


def test_server_that_never_answers_is_bounded_by_timeout() -> None:
    with FakeServer(Behaviour(mode="hang")) as s:
        r = _run_rank(s.endpoint, timeout=2)
    assert r.returncode == 4, r.stderr
    assert "timed out after 2s" in r.stderr  # (the watchdog or the request: both say so)
