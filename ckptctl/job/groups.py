"""Which ranks feed which inference server.

Ranks are grouped by `--inference-parallel-size` (the server's TP size): group g is ranks
[g*size, (g+1)*size). The first rank of a group (its leader) sends that group's IPC handles to
the group's server. Several servers may run on one node (four TP2 servers on eight GPUs): then
`--endpoint`/`--uds` are given once per group on the node, in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ckptctl.defaults import DEFAULT_ENDPOINT
from ckptctl.errors import UsageError
from ckptctl.inference_server import ServerAddress
from ckptctl.launch import LaunchInfo
from ckptctl.settings import ServerKind


@dataclass(frozen=True)
class GroupAssignment:
    rank: int
    group: int  # global group index
    leader: int  # the rank that talks to this group's server
    members: tuple[int, ...]
    address: ServerAddress | None  # set only on the leader

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def assign_group(
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    parallel_size: int,
    endpoints: list[str],
    uds: list[str],
    api_key: str | None = None,
) -> GroupAssignment:
    """The group of `rank` and, for a leader, the server it talks to."""
    if parallel_size < 1:
        raise UsageError("--inference-parallel-size must be at least 1")
    if world_size == 1 and parallel_size > 1:  # (run without torchrun, most likely)
        raise UsageError(
            f"--inference-parallel-size {parallel_size} needs {parallel_size} ranks, one per GPU "
            "of the server, and this job has one (no torchrun, or --nproc-per-node 1): pass "
            "--inference-parallel-size 1 for a server on one GPU, or launch with torchrun "
            f"--nproc-per-node {parallel_size}"
        )
    if parallel_size > world_size or world_size % parallel_size:
        raise UsageError(
            f"--inference-parallel-size {parallel_size} does not divide the world size "
            f"{world_size}: start one rank per GPU of the inference servers "
            f"(torchrun --nproc-per-node) and pass each server's TP size"
        )
    group = rank // parallel_size
    leader = group * parallel_size
    members = tuple(range(leader, leader + parallel_size))

    # Leaders on this node, in rank order: the i-th of them takes the i-th endpoint/uds.
    node_first = rank - rank % local_world_size
    local_leaders = [
        r for r in range(node_first, node_first + local_world_size) if r % parallel_size == 0
    ]
    n_local_groups = max(len(local_leaders), 1)
    for flag, values in (("--endpoint", endpoints), ("--uds", uds)):
        if len(values) > 1 and len(values) != n_local_groups:
            raise UsageError(
                f"{flag} was given {len(values)} times but this node leads {n_local_groups} "
                f"server group(s): give it once, or once per group on the node in group order"
            )
    # Each group needs a server of its own: the Unix socket names it when given, else the URL.
    targets = uds or endpoints
    if n_local_groups > 1 and len(targets) != n_local_groups:
        flag = "--uds" if uds else "--endpoint"
        raise UsageError(
            f"--inference-parallel-size {parallel_size} makes {n_local_groups} server groups on "
            f"this node, but {flag} names {len(targets)} server(s): give {flag} once per group, "
            "in group order (every group needs its own server)"
        )
    address = None
    if rank == leader:
        i = local_leaders.index(rank) if rank in local_leaders else 0
        address = nth_server(i, endpoints, uds, api_key)
    return GroupAssignment(rank, group, leader, members, address)


def nth_server(
    i: int, endpoints: Sequence[str], uds: Sequence[str], api_key: str | None
) -> ServerAddress:
    """The i-th server of --endpoint and --uds paired in order: a flag given once names the
    same for every i (one --endpoint with a --uds per server, as SGLang's sockets are)."""
    endpoint = endpoints[i] if len(endpoints) > 1 else endpoints[0]
    socket = (uds[i] if len(uds) > 1 else uds[0]) if uds else None
    return ServerAddress(endpoint=endpoint, uds=socket, api_key=api_key)


@dataclass(frozen=True)
class GroupPlan:
    """One server group of a job: its ranks, its leader, the node it runs on, its server."""

    group: int
    ranks: tuple[int, ...]
    node: int
    address: ServerAddress

    def as_json(self) -> dict[str, object]:
        return {
            "group": self.group,
            "ranks": list(self.ranks),
            "leader": self.ranks[0],
            "node": self.node,
            "endpoint": self.address.endpoint,
            "uds": self.address.uds,
        }


def group_handles(socket_paths: list[tuple[str, str]], members: tuple[int, ...]) -> dict[str, str]:
    """checkpoint-engine gives (device uuid, zmq path) for every rank, in rank order."""
    return dict(socket_paths[members[0] : members[-1] + 1])


def check_weight_version(kind: ServerKind, weight_version: str | None) -> None:
    """--weight-version is SGLang's (update, join, serve, wait-ready alike)."""
    if weight_version is not None and kind is not ServerKind.sglang:
        raise UsageError("--weight-version needs --engine sglang: vLLM records no weight version")


@dataclass(frozen=True)
class ServerTargets:
    """The inference servers a job feeds (update, join): the flags they share."""

    endpoints: tuple[str, ...] = (DEFAULT_ENDPOINT,)
    uds: tuple[str, ...] = ()
    api_key: str | None = None
    engine: ServerKind = ServerKind.sglang  # (--engine: the servers' kind)
    parallel_size: int = 8
    weight_version: str | None = None

    @classmethod
    def from_flags(
        cls,
        endpoints: Sequence[str] | None,
        uds: Sequence[str] | None,
        api_key: str | None,
        engine: ServerKind,
        parallel_size: int,
        weight_version: str | None,
    ) -> ServerTargets:
        check_weight_version(engine, weight_version)
        from ckptctl.inference_server import check_endpoint

        return cls(
            tuple(check_endpoint(e) for e in endpoints or (DEFAULT_ENDPOINT,)),
            tuple(uds or ()),
            api_key,
            engine,
            parallel_size,
            weight_version,
        )

    def plan(self, world_size: int, local_world_size: int) -> list[GroupPlan]:
        """Every group of a job of `world_size` ranks, `local_world_size` per node, and the
        server its leader talks to: what each rank's `assign` decides, for all of them at once
        (the dry run shows it; it refuses what a real run would refuse)."""
        local = max(min(local_world_size, world_size), 1)
        keyless = replace(self, api_key=None)  # (the plan shows no key)
        out = []
        for leader in range(0, world_size, max(self.parallel_size, 1)):
            a = keyless.assign(
                LaunchInfo(rank=leader, world_size=world_size, local_world_size=local)
            )
            assert a.address is not None  # a leader always has one
            out.append(GroupPlan(a.group, a.members, leader // local, a.address))
        return out

    def assign(self, launch: LaunchInfo) -> GroupAssignment:
        return assign_group(
            rank=launch.rank,
            world_size=launch.world_size,
            local_world_size=launch.local_world_size,
            parallel_size=self.parallel_size,
            endpoints=list(self.endpoints),
            uds=list(self.uds),
            api_key=self.api_key,
        )
