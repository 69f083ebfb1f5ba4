"""`serve --metrics-port`: Prometheus metrics of a real `ckptctl serve` job on CPU (torchrun, 2
ranks, real HTTP to a fake SGLang, checkpoint-engine's ParameterServer stood in by
tests/cpu_ps_rank.py), scraped over HTTP as Prometheus would."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import cpu_serve_job, run_script, wait_for_path
from fake_server import Behaviour, FakeServer, free_master_port
from locations import TINY


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the page: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def _first_scrape(url: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _scrape(url)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _push(sock: str, *args: str) -> dict:
    r = run_script("push", "--control-socket", sock, "--json", *args, timeout=120)
    return {"rc": r.returncode, **json.loads(r.stdout)}


@pytest.mark.slow
def test_a_scrape_follows_the_pushes(short_tmp: Path) -> None:
    sock, port = str(short_tmp / "serve.sock"), free_master_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--metrics-port", str(port)) as job,
    ):
        before = _first_scrape(url)  # up before the job takes pushes (it starts for a while)
        assert wait_for_path(sock)
        assert _value(before, "ckptctl_pushes_total", outcome="ok") == 0
        assert math.isnan(_value(before, "ckptctl_seconds_since_last_good_push"))
        # Bound to loopback's 127.0.0.1 only, not every address: 127.0.0.2 is loopback too.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=5)

        good = _push(sock, "--checkpoint-path", str(TINY), "--weight-version", "v1")
        assert good["rc"] == 0, good
        one = _scrape(url)
        assert _value(one, "ckptctl_pushes_total", outcome="ok") == 1
        assert _value(one, "ckptctl_pushed_bytes_total") == good["total_bytes"] > 0
        assert _value(one, "ckptctl_push_duration_seconds_count") == 1
        assert _value(one, "ckptctl_push_duration_seconds_sum") == pytest.approx(good["wall_s"])
        for stage in ("split", "register", "wait_server", "gather_metas", "update"):
            assert _value(one, "ckptctl_push_stage_duration_seconds_count", stage=stage) == 1
        assert _value(one, "ckptctl_server_wait_seconds_count") == 1
        served = {"push": "1", "weight_version": "v1", "checkpoint_name": "push-1",
                  "checkpoint_path": str(TINY.resolve()), "server_weights": "whole"}  # fmt: skip
        assert _value(one, "ckptctl_served_info", **served) == 1
        assert _value(one, "ckptctl_served_push") == 1
        assert 0 <= _value(one, "ckptctl_seconds_since_last_good_push") < 600
        assert _value(one, "ckptctl_pinned_host_memory_bytes") > 0  # the direct pool's
        assert _value(one, "ckptctl_serve_state", ckptctl_serve_state="idle") == 1

        bad = _push(sock, "--checkpoint-path", str(short_tmp / "missing"))
        assert bad["rc"] == 3, bad
        two = _scrape(url)
        assert _value(two, "ckptctl_pushes_total", outcome="refused") == 1
        assert _value(two, "ckptctl_pushes_total", outcome="ok") == 1  # unchanged
        assert _value(two, "ckptctl_pushed_bytes_total") == good["total_bytes"]
        assert _value(two, "ckptctl_push_duration_seconds_count") == 2
        assert _value(two, "ckptctl_served_info", **served) == 1  # still the first push's
        assert _value(two, "ckptctl_seconds_since_last_good_push") >= _value(
            one, "ckptctl_seconds_since_last_good_push"
        )

        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]


def test_metrics_without_prometheus_client_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptctl.cli._app import run

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    code = run(["serve", "--endpoint", "http://127.0.0.1:1", "--metrics-port", "9400"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "pip install 'ckptctl[metrics]'" in err


def test_the_metrics_name_their_outcomes_and_units() -> None:
    """What a push's answer becomes (the outcome label), and prometheus_client's own output
    for the job's metrics: counters end in _total, sizes in _bytes, times in _seconds."""
    from prometheus_client import generate_latest

    from ckptctl.observe.metrics import ServeMetrics, outcome_of

    assert outcome_of({"ok": True}) == "ok"
    assert outcome_of({"ok": True, "action": "rollback"}) == "rolled_back"
    assert outcome_of({"ok": False, "exit_code": 1, "server_weights": "whole"}) == "restored"
    assert outcome_of({"ok": False, "exit_code": 1, "server_weights": "partial"}) == "failed"
    assert outcome_of({"ok": False, "exit_code": 3}) == "refused"
    assert outcome_of({"ok": False, "exit_code": 130}) == "cancelled"
    page = generate_latest(ServeMetrics(lambda: None).registry).decode()
    names = {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")}
    assert names == {
        "ckptctl_pushes_total", "ckptctl_push_duration_seconds",
        "ckptctl_push_stage_duration_seconds", "ckptctl_server_wait_seconds",
        "ckptctl_pushed_bytes_total", "ckptctl_push_size_bytes", "ckptctl_served_info",
        "ckptctl_served_push", "ckptctl_seconds_since_last_good_push",
        "ckptctl_pinned_host_memory_bytes", "ckptctl_serve_state",
    }  # fmt: skip
    assert "python_gc" not in page and "process_" not in page  # a registry of its own
    # A rollback the server took is a good push: counted under its own outcome, from zero,
    # and the time since the last good push starts again from it.
    assert 'ckptctl_pushes_total{outcome="rolled_back"} 0.0' in page
    metrics = ServeMetrics(lambda: None)
    metrics.pushed({"ok": True, "action": "rollback", "wall_s": 0.5}, [], None)
    page = generate_latest(metrics.registry).decode()
    assert 'ckptctl_pushes_total{outcome="rolled_back"} 1.0' in page
    since = next(
        line for line in page.splitlines() if line.startswith("ckptctl_seconds_since_last_good")
    )
    assert not math.isnan(float(since.split()[-1]))


def test_a_flood_of_idle_connections_costs_a_bounded_few_threads_and_passes() -> None:
    """Whatever reaches the metrics port can open connections and send nothing: only
    MAX_SCRAPERS of them get a thread (the rest are closed at once), those are closed after
    SCRAPE_TIMEOUT_S of silence, and the port answers scrapes again once the flood is gone."""
    import select
    import socket
    import threading

    from ckptctl.observe import metrics

    served = metrics.start("127.0.0.1", 0, lambda: 123)
    host, port = served.address
    before = threading.active_count()
    flood = [
        socket.create_connection((host, port), timeout=10) for _ in range(4 * metrics.MAX_SCRAPERS)
    ]
    try:
        # The server closes every connection past the bound unanswered: wait until it has.
        deadline = time.monotonic() + 30
        closed: set[int] = set()
        while len(closed) < 3 * metrics.MAX_SCRAPERS:
            assert time.monotonic() < deadline, (
                f"only {len(closed)} of {len(flood)} idle connections were closed: the server "
                "keeps a thread for each"
            )
            readable, _, _ = select.select(
                [s for s in flood if s.fileno() not in closed], [], [], 0.2
            )
            for s in readable:
                if s.recv(1) == b"":
                    closed.add(s.fileno())
        assert threading.active_count() <= before + metrics.MAX_SCRAPERS
    finally:
        for s in flood:
            s.close()
    try:
        deadline = time.monotonic() + 30
        while True:  # the slots come free as the idle connections end
            try:
                page = httpx.get(f"http://{host}:{port}/metrics", timeout=5)
                if page.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the metrics port did not answer after the flood"
            time.sleep(0.1)
        assert "ckptctl_pinned_host_memory_bytes 123.0" in page.text
    finally:
        served.close()
