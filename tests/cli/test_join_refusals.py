"""`ckptctl join` refuses, with exit 3 and before any request reaches the server, whatever
cannot work: a bad metas file, metas without p2p addresses, no p2p (mooncake/RDMA) here."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import invoke
from fake_server import FakeServer
from metas_samples import small_metas, write_small_metas

from ckptctl.metas import write_metas_file


def _join(server: FakeServer, metas: Path, *extra: str):  # type: ignore[no-untyped-def]
    return invoke(
        "join",
        "--load-metas-file",
        str(metas),
        "--endpoint",
        server.endpoint,
        "--inference-parallel-size",
        "1",
        "--timeout",
        "10",
        *extra,
    )


def test_metas_with_p2p_addresses_but_no_p2p_here(server: FakeServer, tmp_path: Path) -> None:
    r = _join(server, write_small_metas(tmp_path))
    assert r.exit_code == 3, r.stderr
    assert "join pulls weights over p2p, which cannot start here" in r.stderr
    assert server.behaviour.requests == []


def test_metas_without_p2p_addresses(server: FakeServer, tmp_path: Path) -> None:
    metas = small_metas()
    for entry in metas.values():
        entry.p2p_store_addr = None
        entry.rdma_device = ""
    path = tmp_path / "broadcast-only.json"
    write_metas_file(path, metas, checkpoint_name="ck", world_size=2)
    r = _join(server, path)
    assert r.exit_code == 3
    assert "carry no p2p store address for rank(s) [0, 1]" in r.stderr
    assert server.behaviour.requests == []


def test_missing_and_malformed_metas_files(server: FakeServer, tmp_path: Path) -> None:
    missing = _join(server, tmp_path / "nope.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"format": "something-else"}')
    bad = _join(server, garbage)
    for r in (missing, bad):
        assert r.exit_code == 3 and "Traceback" not in r.stderr
    assert server.behaviour.requests == []


def test_legacy_pickle_needs_allow_pickle(server: FakeServer, tmp_path: Path) -> None:
    path = tmp_path / "seed.pkl"
    path.write_bytes(pickle.dumps(small_metas()))
    r = _join(server, path)
    assert r.exit_code == 3 and "--allow-pickle" in r.stderr
    # With the flag the pickle is read (restricted), then p2p is what is missing here.
    r = _join(server, path, "--allow-pickle")
    assert r.exit_code == 3 and "cannot start here" in r.stderr
    assert server.behaviour.requests == []


@pytest.mark.parametrize("flags", [["--engine", "vllm", "--weight-version", "v1"]])
def test_usage_errors(server: FakeServer, tmp_path: Path, flags: list[str]) -> None:
    assert _join(server, write_small_metas(tmp_path), *flags).exit_code == 2


def test_seed_join_mode_through_update(server: FakeServer, tmp_path: Path) -> None:
    """The seed script joins with `update.py --load-metas-file F`: so does `ckptctl update`."""
    r = invoke(
        "update",
        "--load-metas-file",
        str(write_small_metas(tmp_path)),
        "--endpoint",
        server.endpoint,
        "--inference-parallel-size",
        "1",
        "--timeout",
        "10",
    )
    assert r.exit_code == 3 and "join pulls weights over p2p" in r.stderr
    assert server.behaviour.requests == []


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "--checkpoint-path is required"),
        (["--load-metas-file", "m.json", "--dry-run"], "goes with neither"),
        (["--checkpoint-path", ".", "--dry-run", "--world-size", "100000"], "65536"),
    ],
)
def test_update_flag_combinations(args: list[str], words: str) -> None:
    r = invoke("update", *args)
    assert r.exit_code == 2
    assert words in r.stderr
