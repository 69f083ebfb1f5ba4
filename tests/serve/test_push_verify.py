"""`ckptctl push --verify` (issue 17) on a real `serve` job on CPU: torchrun with 2 ranks, real
HTTP to a fake SGLang that holds the tensors it would have received and answers the weights
checker (tests/support/fake_checker.py), only checkpoint-engine's ParameterServer stood in
(tests/support/cpu_ps_rank.py). A push proves every tensor; one that a server silently corrupted fails
that push, naming the tensor, and the job serves on; a server without a checker is exit 3
before anything is pushed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import cpu_serve_job, run_script, wait_for_path
from fake_checker import HeldWeights
from fake_server import Behaviour, FakeServer
from locations import TINY

Q = "model.layers.0.self_attn.q_proj.weight"

pytestmark = pytest.mark.slow


def _receiving(profile: str, tp_size: int) -> FakeServer:
    """A server that holds what a push of TINY gives it (minus what `behaviour.held` drops)."""
    behaviour = Behaviour(profile=profile, held=HeldWeights(tp_size=tp_size))
    behaviour.on_update = lambda _handles, _body: behaviour.held.receive(TINY)
    return FakeServer(behaviour)


def _push(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_script(
        "push", "--control-socket", sock, "--checkpoint-path", str(TINY), "--verify", *args,
        timeout=100,
    )  # fmt: skip


def _serve_and_push(profile: str, sock: str, between: list, ranks: int = 2) -> list:
    """Start a serve job feeding one TP2 server (`ranks=1`: one process feeding a TP1 server),
    run each step of `between` (each gets the server and returns a push's result), stop the
    job; the job must end cleanly."""
    with (
        _receiving(profile, tp_size=ranks) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, ranks=ranks) as job,
    ):
        assert wait_for_path(sock), "the control socket never appeared"
        results = [step(s) for step in between]
        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    return results


def test_push_verify_proves_every_tensor_and_names_one_a_server_corrupted(short_tmp: Path) -> None:
    sock = str(short_tmp / "serve.sock")

    def corrupt(server: FakeServer) -> None:  # (a dropped tensor would keep push 1's bytes)
        server.behaviour.held.corrupt = {Q}

    def heal(server: FakeServer) -> None:
        server.behaviour.held.corrupt = set()

    ok, _, bad, _, again = _serve_and_push(
        "sglang-pr17009",
        sock,
        [
            lambda s: _push(sock, "--json"),
            corrupt,
            lambda s: _push(sock, "--json"),
            heal,
            lambda s: _push(sock, "--json"),
        ],
    )
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["verified"] == "checksum" and doc["verification"]["tensor_count"] == 25
    assert bad.returncode == 1, bad.stderr
    failed = json.loads(bad.stdout)
    assert failed["ok"] is False and failed["verified"] is None
    assert Q in failed["error"] and "differ from what was sent" in failed["error"]
    assert again.returncode == 0, again.stderr  # the job serves on, and proves the next push
    assert json.loads(again.stdout)["verified"] == "checksum"


def test_push_verify_without_a_checker_is_exit_3_before_anything_is_pushed(
    short_tmp: Path,
) -> None:
    sock = str(short_tmp / "serve.sock")

    def updates(server: FakeServer) -> int:
        return sum(1 for q in server.behaviour.requests if q["path"] == "/update_weights_from_ipc")

    (refused, pushed, plain) = _serve_and_push(
        "sglang-0.5.4",
        sock,
        [lambda s: _push(sock), updates, lambda s: run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY), timeout=100
        )],
        ranks=1,  # (the refusal is the server's: one process is enough)
    )  # fmt: skip
    assert refused.returncode == 3, refused.stderr
    assert pushed == 0  # nothing reached the server
    assert plain.returncode == 0, plain.stderr  # without --verify the same job pushes fine
