"""Rank grouping and which server each group's leader talks to."""

from __future__ import annotations

import pytest

from ckptctl.errors import UsageError
from ckptctl.job.groups import assign_group, group_handles


def _assign(rank: int, world: int, local: int, size: int, endpoints: list[str], uds=()):  # type: ignore[no-untyped-def]
    return assign_group(
        rank=rank,
        world_size=world,
        local_world_size=local,
        parallel_size=size,
        endpoints=endpoints,
        uds=list(uds),
    )


def test_one_tp8_server_on_eight_gpus() -> None:
    groups = [_assign(r, 8, 8, 8, ["http://a:1"]) for r in range(8)]
    assert [g.is_leader for g in groups] == [True] + [False] * 7
    assert groups[0].address is not None and groups[0].address.endpoint == "http://a:1"
    assert all(g.address is None for g in groups[1:])
    assert {g.members for g in groups} == {tuple(range(8))}


def test_four_tp2_servers_take_their_endpoints_in_group_order() -> None:
    endpoints = [f"http://localhost:{19730 + i}" for i in range(4)]
    leaders = [_assign(r, 8, 8, 2, endpoints) for r in (0, 2, 4, 6)]
    assert [g.address.endpoint for g in leaders] == endpoints  # type: ignore[union-attr]
    assert [g.members for g in leaders] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    follower = _assign(5, 8, 8, 2, endpoints)
    assert not follower.is_leader and follower.leader == 4 and follower.address is None


def test_uds_per_group_and_one_endpoint() -> None:
    g = _assign(2, 4, 4, 2, ["http://localhost"], ["/tmp/a.sock", "/tmp/b.sock"])
    assert g.address is not None and g.address.uds == "/tmp/b.sock"


def test_two_nodes_each_with_its_own_server() -> None:
    # torchrun --nnodes 2 --nproc-per-node 1: ranks 0 and 1 each lead a TP1 group on their node.
    for rank in (0, 1):
        g = _assign(rank, 2, 1, 1, ["http://localhost:19730"])
        assert g.is_leader and g.members == (rank,)


def test_tp16_across_two_nodes_has_one_leader_on_node_zero() -> None:
    leaders = [r for r in range(16) if _assign(r, 16, 8, 16, ["http://n0:19730"]).is_leader]
    assert leaders == [0]


@pytest.mark.parametrize(("world", "size"), [(2, 8), (6, 4), (8, 3)])
def test_sizes_that_do_not_divide_the_world_are_usage_errors(world: int, size: int) -> None:
    with pytest.raises(UsageError, match="does not divide"):
        _assign(0, world, world, size, ["http://a"])


def test_endpoint_count_must_match_groups_on_the_node() -> None:
    with pytest.raises(UsageError, match="given 3 times"):
        _assign(0, 8, 8, 2, ["http://a", "http://b", "http://c"])


def test_group_handles_slices_the_groups_sockets() -> None:
    paths = [(f"GPU-{i}", f"ipc://@s{i}") for i in range(4)]
    assert group_handles(paths, (2, 3)) == {"GPU-2": "ipc://@s2", "GPU-3": "ipc://@s3"}


@pytest.mark.parametrize("gb", [0.001, 0.5, 1, 2.3, 8])
def test_bucket_size_is_a_whole_number_of_mib(gb: float) -> None:
    from ckptctl.job.runner import bucket_size_env

    nbytes = int(float(bucket_size_env(gb)) * (1 << 30))  # what checkpoint-engine computes
    assert nbytes % (1 << 20) == 0 and nbytes > 0
    assert abs(nbytes - gb * (1 << 30)) <= 1 << 20


def test_several_groups_on_a_node_need_a_server_each() -> None:
    # The seed script would send all four groups to one server; that can never work.
    with pytest.raises(UsageError, match="makes 4 server groups on this node, but --endpoint"):
        _assign(0, 8, 8, 2, ["http://localhost:19730"])
    with pytest.raises(UsageError, match="--uds names 1 server"):
        _assign(0, 8, 8, 2, [f"http://h:{i}" for i in range(4)], ["/run/one.sock"])


@pytest.mark.parametrize("bad", ["localhost:19730", "http://", "ftp://host/x", "http://[bad"])
def test_malformed_endpoints_are_usage_errors(bad: str) -> None:
    from ckptctl.job.groups import ServerTargets

    with pytest.raises(UsageError, match="is not an http"):
        ServerTargets.from_flags(
            endpoints=[bad],
            uds=None,
            api_key=None,
            engine="sglang",
            parallel_size=1,
            weight_version=None,
        )
