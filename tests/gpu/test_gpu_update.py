"""`torchrun ... ckptctl update` end to end on real GPUs: the real CLI, checkpoint-engine's
ParameterServer, and a receiver whose workers load through
`checkpoint_engine.worker.update_weights_from_ipc` (the call SGLang makes) and check every
tensor bit for bit. Needs CUDA (see tests/gpu/README.md); figures land in $CKPTCTL_GPU_RESULTS.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from ckpt_factory import mixed_shards, mixed_tensors, write_real_checkpoint
from gpu_jobs import (
    assert_bit_exact,
    big_tensors,
    ckptctl_pids,
    finish,
    json_summary,
    needs_two,
    record,
    torchrun_update,
)
from gpu_receiver import ReceiverConfig, ReceiverServer
from torchrun_launch import free_master_port, free_port

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three shards + index.json: every dtype incl. fp8, uint, bool, 0-dim and empty tensors."""
    return write_real_checkpoint(
        tmp_path_factory.mktemp("sharded"), [*mixed_shards(seed=1), big_tensors(2)]
    )


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model.safetensors, mixed dtypes."""
    return write_real_checkpoint(
        tmp_path_factory.mktemp("single"),
        [mixed_tensors(seed=3) | big_tensors(4)],
        names=["model.safetensors"],
    )


# -- it works -------------------------------------------------------------------------------------


# register_mode None: the default (direct), on every path; engine where asked for explicitly.
@pytest.mark.parametrize(
    ("layout", "split", "profile", "uds", "register_mode"),
    [
        ("sharded", "tensors", "sglang-0.5.23", False, None),
        ("sharded", "files", "sglang-0.5.4", False, None),
        ("single", "auto", "sglang-0.5.14", True, None),
        ("sharded", "tensors", "vllm", True, None),
        ("sharded", "tensors", "sglang-0.5.23", False, "engine"),
        ("single", "files", "sglang-0.5.23", True, "engine"),
    ],
)
def test_tp1(
    layout: str,
    split: str,
    profile: str,
    uds: bool,
    register_mode: str | None,
    request: pytest.FixtureRequest,
    short_tmp: Path,
) -> None:
    ckpt = request.getfixturevalue(layout)
    sock = str(short_tmp / "rx.sock") if uds else None
    engine = "vllm" if profile == "vllm" else "sglang"
    with ReceiverServer(ckpt, [0], profile=profile, uds=sock) as rx:
        args = [
            "--checkpoint-path",
            str(ckpt),
            "--inference-parallel-size",
            "1",
            "--split",
            split,
            "--engine",
            engine,
            "--json",
            "--timeout",
            "120",
            "--bucket-size-gb",
            "0.001",
        ]
        if register_mode is not None:
            args += ["--register-mode", register_mode]
        mode = register_mode or "direct"
        args += (
            ["--uds", sock, "--endpoint", "http://localhost"]
            if sock
            else ["--endpoint", rx.endpoint]
        )
        if engine == "sglang":
            args += ["--weight-version", f"v-{layout}-{split}"]
        threads = 3 if mode == "direct" and split == "files" else None
        if threads:
            args += ["--read-threads", str(threads)]
        code, out, err, took = torchrun_update(1, *args)
        assert code == 0, err[-4000:]
        summary = json_summary(out)
        report = assert_bit_exact(rx, ckpt)
    assert summary["ok"] and summary["split"] in ("files", "tensors")
    stages = summary["ranks"][0]["stages"]
    assert stages["register"]["detail"].startswith(f"{mode} registration")
    if mode == "direct":  # read early, metas from the plan (stages.EarlyShare)
        assert "planned in" in stages["split"]["detail"]
        assert stages["gather_metas"]["detail"] == "planned metas, addresses gathered"
        assert f"{threads or ''} reader threads" in stages["register"]["detail"]
        # Pinned through the CUDA driver in the reading thread (host_memory DriverPin).
        assert " through the driver" in stages["register"]["detail"], stages["register"]["detail"]
    if engine == "sglang":
        assert report["weight_version"] == f"v-{layout}-{split}"
        assert "verify" in summary["ranks"][0]["stages"]
    record(
        f"tp1-{layout}-{split}-{profile}-{'uds' if uds else 'tcp'}-{mode}",
        {"wall_s": took, "summary": summary},
    )


def _torch_shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("torch_*")}


@needs_two
@pytest.mark.gpu_serial  # counts torch's files in /dev/shm: none of another test's
@pytest.mark.parametrize("register_mode", [None, "engine"])
def test_tp2_one_server(sharded: Path, register_mode: str | None) -> None:
    # The ranks end with os._exit (no NCCL teardown): torch's CUDA IPC ref-counter files
    # (/dev/shm/torch_<pid>_*) must not be left behind by that, update after update.
    shm_before = _torch_shm_files()
    mode = ["--register-mode", register_mode] if register_mode else []
    with ReceiverServer(sharded, [0, 1]) as rx:
        code, out, err, took = torchrun_update(
            2,
            "--checkpoint-path",
            str(sharded),
            "--inference-parallel-size",
            "2",
            "--endpoint",
            rx.endpoint,
            "--json",
            "--weight-version",
            "tp2",
            "--bucket-size-gb",
            "0.001",
            *mode,
        )
        assert code == 0, err[-4000:]
        assert_bit_exact(rx, sharded)
    left = sorted(_torch_shm_files() - shm_before)
    record(
        f"tp2-one-server-{register_mode or 'direct'}",
        {"wall_s": took, "summary": json_summary(out), "shm_left": left},
    )
    summary = json_summary(out)
    assert len(summary["ranks"]) == 2
    for rank in summary["ranks"]:
        detail = rank["stages"]["gather_metas"].get("detail", "")
        assert (detail == "planned metas, addresses gathered") == (register_mode is None)
    assert not left, f"torch shared-memory files left in /dev/shm: {left}"


@needs_two
def test_two_tp1_servers_under_one_torchrun(sharded: Path) -> None:
    with ReceiverServer(sharded, [0]) as rx0, ReceiverServer(sharded, [1]) as rx1:
        code, out, err, took = torchrun_update(
            2,
            "--checkpoint-path",
            str(sharded),
            "--inference-parallel-size",
            "1",
            "--endpoint",
            rx0.endpoint,
            "--endpoint",
            rx1.endpoint,
            "--json",
        )
        assert code == 0, err[-4000:]
        assert_bit_exact(rx0, sharded)
        assert_bit_exact(rx1, sharded)
    record("two-tp1-servers", {"wall_s": took, "summary": json_summary(out)})


@needs_two
def test_two_torchrun_nodes_on_loopback(sharded: Path) -> None:
    """The multi-node path of the seeds: --nnodes 2, one GPU and one receiver per 'node'."""
    port = free_master_port()
    with ReceiverServer(sharded, [0]) as rx0, ReceiverServer(sharded, [1]) as rx1:
        common = ["--checkpoint-path", str(sharded), "--inference-parallel-size", "1", "--json"]
        node0 = torchrun_update(
            1,
            *common,
            "--endpoint",
            rx0.endpoint,
            nnodes=2,
            node_rank=0,
            master_port=port,
            wait=False,
        )
        node1 = torchrun_update(
            1,
            *common,
            "--endpoint",
            rx1.endpoint,
            nnodes=2,
            node_rank=1,
            master_port=port,
            wait=False,
        )
        r0, r1 = finish(node0, 180), finish(node1, 180)
        assert r0[0] == 0, r0[2][-4000:]
        assert r1[0] == 0, r1[2][-4000:]
        assert_bit_exact(rx0, sharded)
        assert_bit_exact(rx1, sharded)
    assert r1[1].strip() == ""  # only global rank 0 prints the summary
    record("two-nodes", {"wall_s": r0[3], "summary": json_summary(r0[1])})


def test_checkpoint_in_dev_shm_is_left_alone(sharded: Path) -> None:
    """checkpoint-engine pins /dev/shm files in place and deletes them; ckptctl must not."""
    shm = Path("/dev/shm") / f"ckptctl-test-{os.getpid()}"
    shutil.copytree(sharded, shm)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shm.iterdir()}
    try:
        with ReceiverServer(shm, [0]) as rx:
            code, _, err, _ = torchrun_update(
                1,
                "--checkpoint-path",
                str(shm),
                "--inference-parallel-size",
                "1",
                "--endpoint",
                rx.endpoint,
            )
            assert code == 0, err[-4000:]
            assert_bit_exact(rx, shm)
        after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shm.iterdir()}
        assert after == before
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# -- it fails cleanly, every rank, in bounded time -------------------------------------------------


FAILURES = {
    # name: (receiver config, expected rank exit code, words in stderr, extra flags)
    "server refuses (400)": (
        ReceiverConfig(refuse="IPC weight update failed: dp_size must be 1"),
        1,
        "refused the update: HTTP 400: IPC weight update failed: dp_size",
        [],
    ),
    "receiver raises in the last bucket": (
        ReceiverConfig(fail_bucket=-1, hide_swallowed_errors=True),
        1,
        "failed while loading the weights",
        [],
    ),
    "receiver raises in bucket 1": (ReceiverConfig(fail_bucket=1), 1, "", []),
    "answers 200 without connecting": (
        ReceiverConfig(never_connect=True, never_connect_answer_after_s=1),
        1,
        "never took the weights over IPC",
        [],
    ),
    "never answers, never connects": (
        ReceiverConfig(never_connect=True),
        4,
        "timed out after 20s",
        ["--timeout", "20"],
    ),
    "receiver worker dies mid-update": (
        ReceiverConfig(die_in_bucket=1),
        1,
        "",
        ["--timeout", "60"],
    ),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failures_tp1(case: str, sharded: Path) -> None:
    config, want_code, words, extra = FAILURES[case]
    with ReceiverServer(sharded, [0], config=config) as rx:
        code, out, err, took = torchrun_update(
            1,
            "--checkpoint-path",
            str(sharded),
            "--inference-parallel-size",
            "1",
            "--endpoint",
            rx.endpoint,
            "--bucket-size-gb",
            "0.001",
            "--timeout",
            "90",
            *extra,
            timeout=150,
        )
    assert code != 0, "a failed update must not exit 0"
    assert f"exitcode  : {want_code}" in err or f"exitcode: {want_code}" in err, err[-3000:]
    assert words in err, err[-3000:]
    assert "[rank 0] error:" in err or "error:" in err
    assert out.strip() == ""
    record(
        f"failure: {case}",
        {
            "exit_code": want_code,
            "seconds": round(took, 2),
            "message": [line for line in err.splitlines() if "error:" in line][:2],
        },
    )


@needs_two
def test_refusal_ends_both_ranks_tp2(sharded: Path) -> None:
    with ReceiverServer(sharded, [0, 1], config=ReceiverConfig(refuse="no thanks")) as rx:
        code, _, err, took = torchrun_update(
            2,
            "--checkpoint-path",
            str(sharded),
            "--inference-parallel-size",
            "2",
            "--endpoint",
            rx.endpoint,
            "--timeout",
            "90",
        )
    assert code != 0
    assert "[rank 0] error:" in err and "no thanks" in err
    assert took < 60
    record("failure: TP2 refusal", {"seconds": round(took, 2)})


@needs_two
def test_a_rank_killed_mid_update_ends_the_job(sharded: Path) -> None:
    with ReceiverServer(sharded, [0, 1], config=ReceiverConfig(delay_s=6)) as rx:
        proc = torchrun_update(
            2,
            "--checkpoint-path",
            str(sharded),
            "--inference-parallel-size",
            "2",
            "--endpoint",
            rx.endpoint,
            "--timeout",
            "120",
            wait=False,
        )
        deadline = time.monotonic() + 90
        while not rx.behaviour.requests and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = ckptctl_pids(rank=1, master_port=proc.master_port)
        assert victims, "rank 1 not found"
        t_kill = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        code, _, err, _ = finish(proc, 150)
        took = time.monotonic() - t_kill
    assert code != 0
    assert took < 60
    record("failure: rank 1 SIGKILLed mid-update", {"seconds_after_kill": round(took, 2)})


def test_nothing_listening_times_out_with_exit_4(sharded: Path) -> None:
    code, _, err, took = torchrun_update(
        1,
        "--checkpoint-path",
        str(sharded),
        "--inference-parallel-size",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{free_port()}",
        "--timeout",
        "10",
    )
    assert code != 0 and ("exitcode  : 4" in err or "exitcode: 4" in err), err[-3000:]
    assert took < 40
    record("failure: no server, --timeout 10", {"exit_code": 4, "seconds": round(took, 2)})


def test_consume_shm_files_pins_in_place_and_deletes_only_when_asked(tmp_path: Path) -> None:
    # bf16 and fp32 tensors of even sizes: what in-place pinning can serve (a mixed-dtype
    # checkpoint is refused up front: tests/cli/test_consume.py)
    shards = [{f"{k}.{n}": t for n, t in big_tensors(k).items()} for k in (5, 6)]
    original = write_real_checkpoint(tmp_path / "packed", shards)
    shm = Path("/dev/shm") / f"ckptctl-consume-{os.getpid()}"
    shutil.copytree(original, shm)
    try:
        with ReceiverServer(original, [0]) as rx:  # verified against the original files
            code, _, err, _ = torchrun_update(
                1,
                "--checkpoint-path",
                str(shm),
                "--inference-parallel-size",
                "1",
                "--endpoint",
                rx.endpoint,
                "--consume-shm-files",
            )
            assert code == 0, err[-4000:]
            assert_bit_exact(rx, original)
        assert not list(shm.glob("*.safetensors"))  # consumed, as the flag says
    finally:
        shutil.rmtree(shm, ignore_errors=True)
