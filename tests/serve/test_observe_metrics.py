"""`serve --metrics-port`: Prometheus metrics of a real `ckptctl serve` job on CPU (torchrun, 2
ranks, real HTTP to a fake SGLang, checkpoint-engine's ParameterServer stood in by
tests/cpu_ps_rank.py), scraped over HTTP as Prometheus would."""

from __future__ import annotations

import json
import math
import select
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import cpu_serve_job, run_script, wait_for_path, wait_until
from fake_server import Behaviour, FakeServer, free_master_port
from fake_worker import ZmqWorkers
from locations import TINY

from ckptctl.observe import metrics
from ckptctl.observe.metrics import STATES


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


def _status(sock: str) -> dict:
    from ckptctl import client

    return client.status(control_socket=sock)


@pytest.mark.slow
def test_a_scrape_follows_the_pushes(short_tmp: Path, tmp_path: Path) -> None:
    """Every way a push ends, as a scrape sees it: good pushes, a rollback (a good push of its
    own outcome, whose checkpoint is served again), a push that failed mid-transfer and was
    restored (not a good push: no bytes, the last good push's time unchanged), and one refused
    before sending (its own outcome, not timed, and kept apart from `last` in `status`)."""
    sock, port = str(short_tmp / "serve.sock"), free_master_port()
    url = f"http://127.0.0.1:{port}/metrics"
    first = tmp_path / "first"
    shutil.copytree(TINY, first)
    workers = ZmqWorkers()
    with (
        FakeServer(Behaviour(on_update=workers)) as s,
        cpu_serve_job(
            s.endpoint, "--control-socket", sock, "--metrics-port", str(port),
            env={"CPU_PS_TRANSFER": "zmq", "CPU_PS_BUCKETS": "4"},
        ) as job,
    ):  # fmt: skip
        before = _first_scrape(url)  # up before the job takes pushes (it starts for a while)
        assert wait_for_path(sock)
        assert _value(before, "ckptctl_pushes_total", outcome="ok") == 0
        assert math.isnan(_value(before, "ckptctl_last_good_push_timestamp_seconds"))
        assert sum(_value(before, "ckptctl_serve_state", state=st) for st in STATES) == 1
        # Bound to loopback's 127.0.0.1 only, not every address: 127.0.0.2 is loopback too.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=5)

        clock = time.time()
        good = _push(sock, "--checkpoint-path", str(first), "--weight-version", "v1")
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
                  "checkpoint_path": str(first.resolve()), "server_weights": "whole"}  # fmt: skip
        assert _value(one, "ckptctl_served_info", **served) == 1
        assert _value(one, "ckptctl_served_push") == 1
        good_at = _value(one, "ckptctl_last_good_push_timestamp_seconds")
        assert clock <= good_at <= time.time()
        for rank in ("0", "1"):  # each rank's direct pool, though only rank 0 serves the page
            assert _value(one, "ckptctl_pinned_host_memory_bytes", rank=rank) > 0
        assert _value(one, "ckptctl_serve_state", state="idle") == 1
        assert _value(one, "ckptctl_serve_state", state="busy") == 0

        assert _push(sock, "--checkpoint-path", str(TINY), "--weight-version", "v2")["rc"] == 0
        back = json.loads(run_script("rollback", "--control-socket", sock, "--json").stdout)
        assert back["ok"] and back["restores"] == 1, back
        rolled = _scrape(url)
        assert _value(rolled, "ckptctl_pushes_total", outcome="ok") == 2
        assert _value(rolled, "ckptctl_pushes_total", outcome="rolled_back") == 1
        assert _value(rolled, "ckptctl_served_push") == 1  # push 1's checkpoint, served again
        served["checkpoint_name"] = "push-1-rollback-3"  # (registered anew under this name)
        assert _value(rolled, "ckptctl_served_info", **served) == 1
        assert _value(rolled, "ckptctl_pushed_bytes_total") == 3 * good["total_bytes"]
        good_at = _value(rolled, "ckptctl_last_good_push_timestamp_seconds")
        assert good_at >= _value(one, "ckptctl_last_good_push_timestamp_seconds")

        workers.fail_at_bucket = 2  # (once: the restore after it goes through)
        failed = _push(sock, "--checkpoint-path", str(TINY), "--weight-version", "v3")
        assert failed["rc"] == 1 and failed["server_weights"] == "whole", failed
        restored = _scrape(url)
        assert _value(restored, "ckptctl_pushes_total", outcome="restored") == 1
        assert _value(restored, "ckptctl_pushes_total", outcome="ok") == 2
        assert _value(restored, "ckptctl_pushed_bytes_total") == 3 * good["total_bytes"]
        assert _value(restored, "ckptctl_push_size_bytes_count") == 3
        assert _value(restored, "ckptctl_last_good_push_timestamp_seconds") == good_at
        assert _value(restored, "ckptctl_served_info", **served) == 1
        assert _value(restored, "ckptctl_push_duration_seconds_count") == 4

        bad = _push(sock, "--checkpoint-path", str(short_tmp / "missing"))
        assert bad["rc"] == 3 and bad["server_weights"] is None, bad
        refused = _scrape(url)
        assert _value(refused, "ckptctl_pushes_total", outcome="refused") == 1
        assert _value(refused, "ckptctl_pushes_total", outcome="ok") == 2  # unchanged
        assert _value(refused, "ckptctl_pushed_bytes_total") == 3 * good["total_bytes"]
        assert _value(refused, "ckptctl_push_duration_seconds_count") == 4  # not timed
        assert _value(refused, "ckptctl_served_info", **served) == 1  # still push 1's
        assert _value(refused, "ckptctl_last_good_push_timestamp_seconds") == good_at
        # `status` keeps the push that ran as `last`, the refused one apart.
        st = _status(sock)
        assert st["last"]["seq"] == failed["seq"] and st["last"]["exit_code"] == 1, st["last"]
        assert st["last_refused"]["seq"] == bad["seq"] and st["last_refused"]["exit_code"] == 3
        assert st["commands"] == 5 and st["failed"] == 2
        human = run_script("status", "--control-socket", sock, timeout=30).stdout
        assert f"last push {failed['seq']}: {TINY}: failed, restored (exit 1)" in human, human
        assert f"last push {bad['seq']}: {short_tmp / 'missing'}: refused before sending" in human

        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        out, err = job.communicate(timeout=60)
    workers.die()
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
    for the job's metrics: counters end in _total, sizes in _bytes, times in _seconds, a time
    that passes is a timestamp, and no label is named after its metric."""
    from prometheus_client import generate_latest

    from ckptctl.observe.metrics import ServeMetrics, outcome_of

    assert outcome_of({"ok": True}) == "ok"
    assert outcome_of({"ok": True, "action": "rollback"}) == "rolled_back"
    assert outcome_of({"ok": False, "exit_code": 1, "server_weights": "whole"}) == "restored"
    assert outcome_of({"ok": False, "exit_code": 1, "server_weights": "partial"}) == "failed"
    assert outcome_of({"ok": False, "exit_code": 3}) == "refused"
    assert outcome_of({"ok": False, "exit_code": 130}) == "cancelled"
    page = generate_latest(ServeMetrics().registry).decode()
    names = {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")}
    assert names == {
        "ckptctl_pushes_total", "ckptctl_push_duration_seconds",
        "ckptctl_push_stage_duration_seconds", "ckptctl_server_wait_seconds",
        "ckptctl_pushed_bytes_total", "ckptctl_push_size_bytes", "ckptctl_served_info",
        "ckptctl_served_push", "ckptctl_last_good_push_timestamp_seconds",
        "ckptctl_pinned_host_memory_bytes", "ckptctl_serve_state",
    }  # fmt: skip
    assert "python_gc" not in page and "process_" not in page  # a registry of its own
    assert 'ckptctl_pushes_total{outcome="rolled_back"} 0.0' in page  # every outcome from zero
    assert 'ckptctl_serve_state{state="starting"} 1.0' in page
    assert 'ckptctl_serve_state{state="idle"} 0.0' in page


def _samples(m: object) -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    page = generate_latest(m.registry).decode()  # type: ignore[attr-defined]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def test_what_each_ending_of_a_push_changes() -> None:
    """A rollback the server took is a good push of its own outcome, its checkpoint the one
    served; a push restored after a failure is no good push (no bytes, the time of the last
    good one unchanged); a push refused before sending is counted and nothing else; every
    rank's pinned memory comes from its own result in the push's answer."""
    from ckptctl.observe.metrics import ServeMetrics

    m = ServeMetrics()
    ranks = [{"rank": 0, "pinned_pool_bytes": 100}, {"rank": 1, "pinned_pool_bytes": 150}]
    served = {"seq": 1, "weight_version": "v1", "checkpoint_name": "a", "checkpoint_path": "/a"}
    m.ended({"ok": True, "seq": 1, "wall_s": 2.0, "total_bytes": 10, "ranks": ranks,
             "server_weights": "whole"}, [], served)  # fmt: skip
    first = _samples(m)
    good_at = _value(first, "ckptctl_last_good_push_timestamp_seconds")
    assert _value(first, "ckptctl_pinned_host_memory_bytes", rank="1") == 150
    assert _value(first, "ckptctl_serve_state", state="idle") == 1

    m.ended({"ok": False, "exit_code": 1, "seq": 2, "wall_s": 3.0, "total_bytes": 10,
             "server_weights": "whole", "ranks": [{"rank": 1}]}, [], served)  # fmt: skip
    restored = _samples(m)
    assert _value(restored, "ckptctl_pushes_total", outcome="restored") == 1
    assert _value(restored, "ckptctl_pushed_bytes_total") == 10
    assert _value(restored, "ckptctl_push_size_bytes_count") == 1
    assert _value(restored, "ckptctl_last_good_push_timestamp_seconds") == good_at
    assert _value(restored, "ckptctl_pinned_host_memory_bytes", rank="1") == 150  # kept

    m.ended({"ok": False, "exit_code": 3, "seq": 3, "wall_s": 0.01, "server_weights": None},
            [], served)  # fmt: skip
    refused = _samples(m)
    assert _value(refused, "ckptctl_pushes_total", outcome="refused") == 1
    assert _value(refused, "ckptctl_push_duration_seconds_count") == 2  # not timed

    time.sleep(0.01)  # (a later wall-clock time for the rollback)
    m.ended({"ok": True, "action": "rollback", "seq": 4, "restores": 1, "wall_s": 0.5,
             "total_bytes": 10, "server_weights": "whole"}, [], served)  # fmt: skip
    rolled = _samples(m)
    assert _value(rolled, "ckptctl_pushes_total", outcome="rolled_back") == 1
    assert _value(rolled, "ckptctl_pushes_total", outcome="ok") == 1
    assert _value(rolled, "ckptctl_served_push") == 1
    assert _value(rolled, "ckptctl_pushed_bytes_total") == 20
    assert _value(rolled, "ckptctl_last_good_push_timestamp_seconds") > good_at

    m.ended({"ok": True, "action": "stage", "seq": 5, "total_bytes": 10, "server_weights": None,
             "ranks": [{"rank": 0, "pinned_pool_bytes": 200}]}, [], served)  # fmt: skip
    staged = _samples(m)  # a read ahead: no push, but more memory pinned
    assert _value(staged, "ckptctl_pinned_host_memory_bytes", rank="0") == 200
    assert sum(_value(staged, "ckptctl_pushes_total", outcome=o) for o in metrics.OUTCOMES) == 4


# -- the HTTP it speaks, to clients it does not trust -----------------------------------------


def _slow_client(host: str, port: int, stop: threading.Event, seen: dict[str, int]) -> None:
    """A slow-loris: it sends a request line, then a byte of a header every 0.1 s, never ending
    its request; cut off, it connects again at once. `seen` counts its connections and cuts."""
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                seen["connected"] += 1
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                while not stop.wait(0.1):
                    s.sendall(b"x")
        except OSError:  # cut off (a reset, or a broken pipe as it sends)
            seen["cut_off"] += 1


def _metrics_threads() -> int:
    return sum(t.name == "ckptctl-metrics" for t in threading.enumerate())


def test_slow_clients_never_keep_a_scraper_out() -> None:
    """16 slow clients (twice the connections a server of 8 holds), each reconnecting the
    moment it is cut off, beside a scraper: every scrape gets its page within Prometheus's own
    default deadline (10 s for the whole exchange); the server holds at most its 8
    connections, on its one thread, cutting the slow ones off for room."""
    from ckptctl.bounded_http import bounded_client

    server = metrics.MetricsServer(
        "127.0.0.1", 0, lambda: b"ckptctl_pushes_total 0\n", "text/plain", max_connections=8
    )
    host, port = server.address
    stop, seen = threading.Event(), {"connected": 0, "cut_off": 0}
    peak = [0]

    def watch() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], server.open_connections)

    threads = [threading.Thread(target=watch, daemon=True)] + [
        threading.Thread(target=_slow_client, args=(host, port, stop, seen), daemon=True)
        for _ in range(16)
    ]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: seen["connected"] >= 16, 30, "16 slow clients connected")
        with bounded_client(f"http://{host}:{port}", timeout=10) as scraper:
            for _ in range(5):
                page = scraper.get("/metrics")  # (raises at the deadline)
                assert page.status_code == 200 and "ckptctl_pushes_total" in page.text
                assert page.headers["content-type"].startswith("text/plain")
        # (the slow clients were there, and were cut off for room, not at their deadline)
        wait_until(lambda: seen["cut_off"] > 0, 5, "a slow client cut off for room")
        assert 0 < peak[0] <= 8, peak
        assert _metrics_threads() == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        server.close()


# Another process (its own interpreter: the server's thread does not share its GIL) that
# keeps COUNT connections open to the port, sending nothing, each opened again the moment the
# server closes it; it prints "flooding" once all are open, then the number of reconnections.
_FLOODER = """
import selectors, socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sel = selectors.DefaultSelector()
def connect():
    s = socket.socket(); s.setblocking(False); s.connect_ex((host, port))
    sel.register(s, selectors.EVENT_READ)
for _ in range(count):
    connect()
print("flooding", flush=True)
reconnects, reported = 0, time.monotonic()
while True:
    for key, _ in sel.select(0.5):
        try:
            data = key.fileobj.recv(1)
        except OSError:
            data = b""
        if not data:
            sel.unregister(key.fileobj); key.fileobj.close(); connect(); reconnects += 1
    if time.monotonic() - reported > 0.5:
        print(reconnects, flush=True); reported = time.monotonic()
"""


def test_a_flood_of_idle_connections_never_keeps_a_scraper_out() -> None:
    """300 connections that send nothing and reconnect the moment they are closed (more than
    the server holds): every scrape still gets its page within Prometheus's default deadline,
    and the server cut flood connections off for room (it reconnected them)."""
    import subprocess

    from ckptctl.bounded_http import bounded_client

    server = metrics.MetricsServer("127.0.0.1", 0, lambda: b"ckptctl_up 1\n", "text/plain")
    host, port = server.address
    flooder = subprocess.Popen(
        [sys.executable, "-c", _FLOODER, host, str(port), "300"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flooder.stdout is not None
        assert flooder.stdout.readline().strip() == "flooding"
        wait_until(lambda: server.open_connections >= metrics.MAX_CONNECTIONS, 30, "a full room")
        with bounded_client(f"http://{host}:{port}", timeout=10) as scraper:
            for _ in range(5):
                page = scraper.get("/metrics")  # (raises at the deadline)
                assert page.status_code == 200 and page.text == "ckptctl_up 1\n"
        assert server.open_connections <= metrics.MAX_CONNECTIONS
        assert int(flooder.stdout.readline()) > 0, "the server never cut a flood connection off"
    finally:
        flooder.kill()
        flooder.wait(timeout=30)
        server.close()


def _ended_by_server(s: socket.socket, timeout: float = 30) -> bytes:
    """What the server sent before it closed the connection (fails the test past `timeout`)."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_a_request_has_one_deadline_and_a_bounded_head() -> None:
    """A client that keeps sending, a byte every 0.1 s, is cut off at the request's deadline
    (one for the whole request, not one for each read); a request head past the cap is cut
    off at once, long before its deadline (431 where the answer arrives before the close); a
    path other than /metrics is 404, another method 405."""
    quick = metrics.MetricsServer("127.0.0.1", 0, lambda: b"page\n", "text/plain", deadline_s=1)
    try:
        with socket.create_connection(quick.address, timeout=30) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            deadline = time.monotonic() + 30
            with pytest.raises(OSError):  # (a reset or a broken pipe once it is cut off)
                while time.monotonic() < deadline:
                    s.sendall(b"x")
                    time.sleep(0.1)
                    if select.select([s], [], [], 0)[0] and s.recv(1) == b"":
                        raise ConnectionAbortedError
            assert time.monotonic() < deadline, "a trickling request was never cut off"
    finally:
        quick.close()
    # A deadline far beyond the test's own: only the cap can end these in time.
    patient = metrics.MetricsServer("127.0.0.1", 0, lambda: b"page\n", "text/plain", deadline_s=600)
    try:
        with socket.create_connection(patient.address, timeout=30) as s:
            s.sendall(b"GET /" + b"a" * 20_000)  # (no end of the line: it could go on for ever)
            said = _ended_by_server(s)
            assert said == b"" or said.startswith(b"HTTP/1.1 431 "), said
        for request, status in (
            (b"GET /other HTTP/1.1\r\n\r\n", b"404"),
            (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
            (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
        ):
            with socket.create_connection(patient.address, timeout=30) as s:
                s.sendall(request)
                assert _ended_by_server(s).startswith(b"HTTP/1.1 " + status), request
    finally:
        patient.close()


def test_a_page_that_raises_is_answered_500_and_the_server_goes_on() -> None:
    """A page that raises (a collector that breaks) is that scrape's 500: it used to escape
    the server's one thread and end metrics for good, every later scrape unanswered."""
    calls = [0]

    def page() -> bytes:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a collector broke")
        return b"ckptctl_up 1\n"

    server = metrics.MetricsServer("127.0.0.1", 0, page, "text/plain")
    try:
        for status, body in ((b"500", b""), (b"200", b"ckptctl_up 1\n")):
            with socket.create_connection(server.address, timeout=30) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                said = _ended_by_server(s)
                assert said.startswith(b"HTTP/1.1 " + status) and said.endswith(body), said
        assert server._thread.is_alive()
    finally:
        server.close()


# Out of file descriptors (a low limit, all of them taken) with a connection in the listen
# queue: the server cannot take it, and has none of its own to close for room. Prints how
# many times it tried in 1 s, then the answer the connection gets once descriptors are free.
_OUT_OF_FDS = """
import os, resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ckptctl.observe import metrics
tries = [0]
class Counting(metrics.MetricsServer):
    def _accept(self):
        tries[0] += 1
        super()._accept()
server = Counting("127.0.0.1", 0, lambda: b"ckptctl_up 1\\n", "text/plain")
client = socket.socket()  # (its descriptor taken before they run out)
taken = []
try:
    while True:
        taken.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
client.connect(server.address)  # (queued by the kernel: no descriptor of ours needed)
deadline = time.monotonic() + 30
while tries[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
first = tries[0]
time.sleep(1)
print(tries[0] - first, flush=True)
for fd in taken:
    os.close(fd)
client.settimeout(30)
client.sendall(b"GET /metrics HTTP/1.1\\r\\n\\r\\n")
print(client.recv(100).split(b"\\r\\n")[0].decode(), flush=True)
server.close()
"""


def test_out_of_file_descriptors_the_server_does_not_spin() -> None:
    """accept() failing for want of a descriptor, with no connection of its own to close: the
    server tries again a few times a second (it tried in a busy loop, a core at 100% for as
    long as the descriptors stayed short), and answers once they are free again."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _OUT_OF_FDS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    tries, answer = out.stdout.split("\n")[:2]
    assert int(tries) <= 50, f"{tries} tries to accept in 1 s: a busy loop"
    assert answer == "HTTP/1.1 200 OK"
