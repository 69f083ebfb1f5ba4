"""--json: exactly one document on stdout, also on failure, also when native code writes to fd 1."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import assert_failure_document, run_script
from locations import TINY


def test_native_writes_to_fd_1_go_to_stderr_during_a_job() -> None:
    code = textwrap.dedent(
        """
        import os, sys
        from ckptctl import results
        results.expect(sys.stdout)
        with results.protect_stdout():
            os.write(1, b"NCCL INFO native noise\\n")   # what NCCL_DEBUG does
            print("a stray print")
            results.write({"ok": True})
        print("after the job, stdout is stdout again")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert json.loads(lines[0]) == {"ok": True, "exit_code": 0, "error": None}
    assert lines[1:] == ["after the job, stdout is stdout again"]
    assert "native noise" in r.stderr and "a stray print" in r.stderr


@pytest.mark.no_cuda
def test_failed_gpu_command_still_writes_one_document() -> None:
    r = run_script(
        "update",
        "--checkpoint-path",
        str(TINY),
        "--inference-parallel-size",
        "1",
        "--json",
        "--timeout",
        "30",
    )
    assert r.returncode == 1
    assert "no CUDA device" in assert_failure_document(r.stdout, 1)["error"]


def test_usage_errors_from_our_checks_write_one_document_too() -> None:
    r = run_script("wait-ready", "--endpoint", "localhost:1", "--json")
    assert r.returncode == 2
    assert_failure_document(r.stdout, 2)
