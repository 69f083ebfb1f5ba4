"""`--verify`'s parts against real servers on loopback that answer like each SGLang version's
weights checker (tests/support/fake_checker.py, WEIGHTS-CHECKER.md): what a server offers, how the job
verifies, the SHA-256s, per-engine agreement, the round trip, and hostile answers."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
from conftest import invoke
from fake_checker import ROPE_BUFFER, HeldWeights, read_checkpoint
from fake_server import Behaviour, FakeServer
from locations import TINY

from ckptctl.errors import DeadlineExceeded, InvalidInput, OperationFailed
from ckptctl.inference_server import ServerAddress
from ckptctl.weights_checker import (
    Checker,
    ServerChecksums,
    check_expected,
    compare_servers,
    parse_checksums,
    plan_verification,
    probe,
    round_trip_compare,
    sha256_tensors,
)

Q = "model.layers.0.self_attn.q_proj.weight"


def _checker(server: FakeServer, seconds: float = 10.0) -> Checker:
    return Checker(ServerAddress(server.endpoint), deadline=time.monotonic() + seconds)


def _expected() -> dict[str, str]:
    return {n: hashlib.sha256(t.data).hexdigest() for n, t in read_checkpoint(TINY).items()}


@pytest.mark.parametrize(
    ("profile", "offers"),
    [
        ("sglang-0.5.4", []),
        ("sglang-0.5.9", ["compare"]),
        ("sglang-0.5.12", ["checksum", "compare"]),
        ("sglang-0.5.14", ["checksum", "compare"]),
        ("sglang-0.5.23", ["checksum", "compare"]),
        ("sglang-pr17009", ["compare_checksum", "checksum", "compare"]),
    ],
)
def test_what_each_version_offers_is_read_from_its_answers(profile: str, offers: list[str]) -> None:
    with FakeServer(Behaviour(profile=profile)) as s:
        assert probe(_checker(s)) == offers


def test_how_the_job_verifies_or_why_it_cannot() -> None:
    new, sha, old = (
        ["checksum", "compare"],
        ["compare_checksum", "checksum", "compare"],
        ["compare"],
    )
    assert plan_verification([("a", sha), ("b", sha)], round_trip=False) == "checksum"
    assert plan_verification([("a", sha), ("b", new)], round_trip=False) == "per-engine"
    assert plan_verification([("a", new), ("b", new)], round_trip=False) == "per-engine"
    assert plan_verification([("a", new)], round_trip=True) == "round-trip"
    cases = [
        ([("a", new), ("b", [])], "b has no weights checker"),
        ([("a", old), ("b", new)], "a offers only snapshot/reset_tensors/compare"),
        ([("a", new)], "this job feeds one server"),
    ]
    for offers, why in cases:
        with pytest.raises(InvalidInput, match=why) as err:
            plan_verification(offers, round_trip=False)
        assert "nothing was pushed" in str(err.value)
    with pytest.raises(InvalidInput, match="resets its RoPE caches too"):
        plan_verification([("a", old)], round_trip=True)


def test_the_sha256_of_every_tensor_proves_it_and_names_what_differs() -> None:
    held = HeldWeights(tp_size=2, drop={Q}, corrupt={"lm_head.weight"})
    held.receive(TINY)
    with FakeServer(Behaviour(profile="sglang-pr17009", held=held)) as s:
        with pytest.raises(OperationFailed) as err:
            check_expected(_checker(s), _expected())
        held.drop, held.corrupt = set(), set()
        held.receive(TINY)
        check_expected(_checker(s), _expected())  # now it holds every byte
    assert "2 tensor(s) differ from what was sent: lm_head.weight, " + Q in str(err.value)


def test_hashes_match_hashlib_with_any_number_of_threads() -> None:
    items = [(n, bytes(t.data)) for n, t in read_checkpoint(TINY).items()]
    one = sha256_tensors(items, threads=1)
    assert one == sha256_tensors(items, threads=4) == _expected()


def _sums(server: FakeServer) -> ServerChecksums:
    answer = _checker(server).require("checksum")
    return parse_checksums(answer.doc or {}, server.endpoint)


@pytest.mark.parametrize("profile", ["sglang-0.5.12", "sglang-0.5.14", "sglang-0.5.23"])
def test_servers_given_the_same_checkpoint_agree_and_one_corruption_is_named(profile: str) -> None:
    helds = [HeldWeights(tp_size=2) for _ in range(3)]
    helds[2].corrupt = {Q}
    for h in helds:
        h.receive(TINY)
    servers = [FakeServer(Behaviour(profile=profile, held=h)).start() for h in helds]
    try:
        reports = [(s.endpoint, _sums(s)) for s in servers]
    finally:
        for s in servers:
            s.stop()
    assert compare_servers(reports[:2]) == []
    (problem,) = compare_servers(reports)
    assert problem.startswith(f"{servers[2].endpoint} differs from the other server(s) in 1 ")
    assert f"dp0/pp0/tp0 {Q}" in problem
    (tied,) = compare_servers(reports[1:])
    assert "disagree (no majority)" in tied and Q in tied
    ranks = 1 if profile == "sglang-0.5.12" else 2  # 0.5.12 reports TP rank 0 only
    assert len(reports[0][1].ranks) == ranks


def test_the_engine_digest_ignores_the_order_ranks_arrive_in() -> None:
    a = ServerChecksums({"dp0/pp0/tp0": {"w": "1"}, "dp1/pp0/tp0": {"w": "2"}})
    b = ServerChecksums({"dp1/pp0/tp0": {"w": "2"}, "dp0/pp0/tp0": {"w": "1"}})
    assert a.digest() == b.digest()


def test_servers_of_other_layouts_cannot_be_compared() -> None:
    one, two = HeldWeights(tp_size=1), HeldWeights(tp_size=2)
    for h in (one, two):
        h.receive(TINY)
    with (
        FakeServer(Behaviour(profile="sglang-0.5.23", held=one)) as a,
        FakeServer(Behaviour(profile="sglang-0.5.23", held=two)) as b,
    ):
        reports = [(a.endpoint, _sums(a)), (b.endpoint, _sums(b))]
    with pytest.raises(InvalidInput, match="report different parameters"):
        compare_servers(reports)


def test_the_round_trip_finds_a_dropped_tensor_and_leaves_rope_caches_alone() -> None:
    held = HeldWeights.started_from(TINY, tp_size=2)
    rope = bytes(held.tensors[ROPE_BUFFER].data)
    with FakeServer(Behaviour(profile="sglang-0.5.23", held=held)) as s:
        c = _checker(s)
        c.require("snapshot")
        c.require("reset_tensors")
        held.drop = {Q}
        held.receive(TINY)
        with pytest.raises(OperationFailed, match=f"1 parameter\\(s\\) differ: {Q} "):
            round_trip_compare(c)
        held.drop = set()
        held.receive(TINY)  # whole again, then a second round (0.5.23 drops a used snapshot)
        c.require("snapshot")
        c.require("reset_tensors")
        held.receive(TINY)
        round_trip_compare(c)
    assert bytes(held.tensors[ROPE_BUFFER].data) == rope


def test_sglang_0_5_6_to_0_5_11_reset_the_rope_caches_too() -> None:
    """The reason --verify-round-trip refuses them (WEIGHTS-CHECKER.md)."""
    held = HeldWeights.started_from(TINY)
    with FakeServer(Behaviour(profile="sglang-0.5.9", held=held)) as s:
        c = _checker(s)
        c.require("snapshot")
        c.require("reset_tensors")
        held.receive(TINY)
        with pytest.raises(OperationFailed, match=ROPE_BUFFER):
            round_trip_compare(c)


def test_compare_without_a_snapshot_says_so() -> None:
    with (
        FakeServer(Behaviour(profile="sglang-0.5.23")) as s,
        pytest.raises(OperationFailed, match="was the snapshot lost"),
    ):
        round_trip_compare(_checker(s))


# -- hostile servers ---------------------------------------------------------------------------


def _route(server: FakeServer, answer: tuple[int, Any]) -> None:
    server.behaviour.routes[("POST", "/weights_checker")] = lambda _doc: answer


def test_an_oversized_answer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptctl.weights_checker as verify

    monkeypatch.setattr(verify, "MAX_ANSWER_BYTES", 1 << 16)
    with FakeServer(Behaviour()) as s:
        _route(s, (200, {"success": True, "ranks": ["x" * 1000] * 100}))
        with pytest.raises(OperationFailed, match="more than 0 MiB"):
            _checker(s).ask("checksum")


def test_a_server_that_never_answers_ends_at_the_deadline() -> None:
    with FakeServer(Behaviour(mode="hang")) as s, pytest.raises(DeadlineExceeded):
        probe(_checker(s, seconds=1.0))  # (only the deadline can end a call to a hung server)


@pytest.mark.parametrize(
    "answer",
    [
        (200, {"success": True, "ranks": "no"}),
        (200, {"success": True, "ranks": [{"checksums": {"w": 1}}]}),
        (200, {"success": True}),
    ],
)
def test_a_checksum_answer_not_shaped_like_sglang_is_refused(answer: tuple[int, Any]) -> None:
    with FakeServer(Behaviour()) as s:
        _route(s, answer)
        with pytest.raises(OperationFailed, match="is not SGLang's"):
            _sums(s)


def test_garbage_on_the_route_is_not_taken_for_a_checker() -> None:
    with FakeServer(Behaviour()) as s:
        _route(s, (200, ["not", "an", "object"]))
        with pytest.raises(OperationFailed, match="not a weights checker ckptctl knows"):
            probe(_checker(s))


def test_a_refused_api_key_is_one_line_naming_the_flag() -> None:
    with (
        FakeServer(Behaviour(api_key="secret")) as s,
        pytest.raises(OperationFailed, match="refused the API key.*--api-key"),
    ):
        probe(_checker(s))


# -- the flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--verify-round-trip"], "confirm with --reset-served-weights"),
        (["--reset-served-weights"], "only goes with --verify-round-trip"),
        (["--verify", "--verify-round-trip", "--reset-served-weights"], "not both"),
        (["--verify", "--engine", "vllm"], "needs --engine sglang"),
        (["--verify", "--dry-run"], "not --dry-run"),
        (["--verify-round-trip", "--reset-served-weights", "--load-metas-file", "m"], "not a join"),
    ],
)
def test_flag_combinations_that_cannot_work_are_usage_errors(args: list[str], why: str) -> None:
    r = invoke("update", "--checkpoint-path", str(TINY), *args)
    assert r.exit_code == 2
    assert why in r.stderr


def test_join_verify_with_vllm_is_a_usage_error() -> None:
    r = invoke("join", "--load-metas-file", "m", "--verify", "--engine", "vllm")
    assert r.exit_code == 2 and "needs --engine sglang" in r.stderr


def test_buffer_views_read_checkpoint_engines_layout() -> None:
    """What the real session hashes: each tensor at its aligned offset in a MemoryBuffer."""
    import torch
    from checkpoint_engine.data_types import MemoryBuffer, ParameterMeta

    from ckptctl.ce import buffer_views

    tensors = {
        "a": torch.arange(3, dtype=torch.bfloat16),
        "b": torch.tensor(7.0),
        "c": torch.ones(2, 2, dtype=torch.bool),
    }
    buf = torch.zeros(3 * 256, dtype=torch.uint8)
    metas = []
    for i, (name, t) in enumerate(tensors.items()):
        raw = t.reshape(-1).view(torch.uint8)
        buf[i * 256 : i * 256 + raw.numel()] = raw
        metas.append(ParameterMeta(name=name, dtype=t.dtype, shape=t.shape, aligned_size=256))
    views = buffer_views([MemoryBuffer(buffer=buf, size=buf.numel(), metas=metas)])
    assert [(n, bytes(v)) for n, v in views] == [
        (n, t.reshape(-1).view(torch.uint8).numpy().tobytes()) for n, t in tensors.items()
    ]


def test_the_gpu_receivers_checker_answers_like_the_cpu_fake() -> None:
    """tests/support/gpu_receiver.py's worker ops, run here on CPU tensors: the same checksums, shards
    and SHA-256s as fake_checker's, so the GPU test checks what the CPU tests check."""
    import gpu_receiver
    from safetensors.torch import load_file

    loaded: dict[str, Any] = {}
    for f in sorted(TINY.glob("*.safetensors")):
        loaded.update(load_file(str(f)))
    params = [{n: t.clone() for n, t in loaded.items()} for _ in range(2)]
    states: list[dict[str, Any]] = [{}, {}]

    class Receiver:
        devices = [0, 1]

        def ask_workers(self, op: str, indices: list[int] | None = None) -> list[Any]:
            return [
                gpu_receiver._checker_op(params[i], states[i], op, i, 2)
                for i in (indices if indices is not None else [0, 1])
            ]

    weights = gpu_receiver._GpuWeights(Receiver())  # type: ignore[arg-type]
    held = HeldWeights.started_from(TINY, tp_size=2)
    assert weights.tp_size == 2
    for rank in (0, 1):
        assert weights.rank_checksums(rank) == held.rank_checksums(rank)
    assert weights.sha256() == {n: h for n, h in held.sha256().items() if n != ROPE_BUFFER}
    assert weights.differs_from_snapshot() is None
    weights.snapshot()
    weights.reset(rope_too=False)
    changed = weights.differs_from_snapshot()
    assert changed is not None and Q in changed
    for i in (0, 1):
        params[i][Q].copy_(loaded[Q])
    weights.drop_snapshot()
    assert weights.differs_from_snapshot() is None


def test_what_a_server_says_reaches_the_error_line_without_terminal_escapes() -> None:
    with FakeServer(Behaviour(profile="sglang-0.5.23")) as s:
        _route(s, (400, {"success": False, "message": "name=\x1b[31mevil\x1b[0m\nmore"}))
        with pytest.raises(OperationFailed) as err:
            round_trip_compare(_checker(s))
    assert "\x1b" not in str(err.value) and "\n" not in str(err.value)
