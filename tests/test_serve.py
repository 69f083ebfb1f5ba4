"""A real torchrun `serve` job on CPU driven through its control socket by `ckptctl push` and
`ckptctl status`: commands reach every rank in order, a failed push leaves the job serving."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import run_script, wait_for_path
from fake_server import torchrun_cmd

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-checkpoint"
SCRIPT = str(Path(__file__).with_name("serve_rank.py"))

pytestmark = pytest.mark.slow


def test_push_status_and_a_failed_push_in_between(short_tmp: Path) -> None:
    sock = str(short_tmp / "serve.sock")
    job = subprocess.Popen(
        torchrun_cmd(SCRIPT, sock),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for_path(sock), "the control socket never appeared"

        good = run_script(
            "push",
            "--control-socket",
            sock,
            "--checkpoint-path",
            str(TINY),
            "--checkpoint-name",
            "step-1",
            "--json",
            timeout=60,
        )
        assert good.returncode == 0, good.stderr
        doc = json.loads(good.stdout)
        assert doc["ok"] and doc["seq"] == 1
        assert sum(r["tensors"] for r in doc["ranks"]) == 25  # every tensor, once, over 2 ranks

        bad = run_script(
            "push",
            "--control-socket",
            sock,
            "--checkpoint-path",
            str(short_tmp / "missing"),
            timeout=60,
        )
        assert bad.returncode == 3
        assert "missing" in bad.stderr

        # A push that fails with a plain exception on one rank (checkpoint-engine raises
        # those) fails like any other: exit 1, and the job goes on.
        boom = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY),
            "--checkpoint-name", "boom", timeout=60,
        )  # fmt: skip
        assert boom.returncode == 1, boom.stderr
        assert "RuntimeError: injected" in boom.stderr

        again = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY), timeout=60
        )
        assert again.returncode == 0, again.stderr  # the job is still usable

        status = run_script("status", "--control-socket", sock, "--json", timeout=30)
        assert status.returncode == 0
        st = json.loads(status.stdout)
        assert st["state"] == "idle" and st["commands"] == 4 and st["world_size"] == 2
        assert st["last"]["ok"] and st["last"]["seq"] == 4

        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as client:
            assert client.post("http://serve/stop").json() == {"ok": True}
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert "rank 1: stopped by a client (POST /stop)" in out
    assert not os.path.exists(sock)


def test_push_without_a_serve_job_says_so(short_tmp: Path) -> None:
    r = run_script(
        "push", "--control-socket", str(short_tmp / "none.sock"), "--checkpoint-path", str(TINY)
    )
    assert r.returncode == 1 and "no serve job answers" in r.stderr
