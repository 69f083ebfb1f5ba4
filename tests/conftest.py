"""Shared fixtures: real fake servers, and running the CLI in-process or as the installed script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_server import Behaviour, FakeServer
from typer.testing import CliRunner

from ckptctl.cli import app


@pytest.fixture
def server() -> Iterator[FakeServer]:
    """An SGLang 0.5.23-like server on a loopback port, waiting for its first weights."""
    with FakeServer(Behaviour()) as s:
        yield s


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: Unix socket paths must stay under ~100 bytes."""
    d = tempfile.mkdtemp(prefix="ck", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def invoke(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """Run the CLI in-process (Typer's CliRunner keeps stdout and stderr apart)."""
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


def ckptctl_script() -> str:
    """The installed console script next to this interpreter."""
    script = Path(sys.executable).with_name("ckptctl")
    return str(script) if script.exists() else shutil.which("ckptctl") or "ckptctl"


def run_script(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [ckptctl_script(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        **kw,
    )


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no CUDA
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA and checkpoint-engine's ParameterServer: skip them on CPU."""
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (run on a GPU node: python -m pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def assert_failure_document(stdout: str, code: int) -> dict:
    """With --json a failed command still writes exactly one JSON document: the failure."""
    import json

    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON document on stdout, got {stdout!r}"
    doc = json.loads(lines[0])
    assert doc["ok"] is False and doc["exit_code"] == code and doc["error"]
    return doc


def wait_for_path(path: str, timeout: float = 60) -> bool:
    """Wait until `path` exists (a job's control socket, a file it writes)."""
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.path.exists(path)
