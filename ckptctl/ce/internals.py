"""checkpoint-engine's private attributes: touched here, and nowhere else in ckptctl.

Where its public API has no hook, ckptctl wraps the ParameterServer's zmq socket factory and
its copy of a bucket out of the host buffers, starts its socket counter at random, hands it
buffers pinned by us, and sets what gather_metas would from the shared plan. None of it is a promised interface: on a version other than
WRITTEN_FOR it refuses with one line before touching anything, and names a missing attribute.
The version helpers import neither torch nor checkpoint-engine (`ckptctl doctor` uses them).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from ckptctl.errors import OperationFailed

DISTRIBUTION = "checkpoint-engine"
WRITTEN_FOR = ">=0.4.2,<0.5"  # the range pyproject.toml pins


def installed_version() -> str | None:
    """The installed checkpoint-engine's version (its package metadata), None if there is none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def version_problem() -> str | None:
    """Why the installed checkpoint-engine will not do, in one line; None when it will."""
    found, pip = installed_version(), f"pip install '{DISTRIBUTION}{WRITTEN_FOR}'"
    if found is None:
        return f"{DISTRIBUTION} is not installed ({pip})"
    if _satisfies(found, WRITTEN_FOR):
        return None
    return f"{DISTRIBUTION} {found} is installed; ckptctl is written for {WRITTEN_FOR} ({pip})"


def _satisfies(version: str, specifier: str) -> bool:
    """Whether `version` meets `specifier` (">=A,<B"), as PEP 440 reads it: a pre- or dev
    release of A is below A, and `<B` does not admit one of B either."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)([^+]*)(\+.*)?", version.strip().lower())
    bounds = re.fullmatch(r">=\s*([\d.]+)\s*,\s*<\s*([\d.]+)", specifier.strip())
    assert bounds is not None, f"not a >=A,<B range: {specifier!r}"
    if match is None:
        return False
    have, low, high = (tuple(map(int, v.split("."))) for v in (match[1], *bounds.groups()))
    have, low, high = (v + (0,) * (4 - len(v)) for v in (have, low, high))
    final = re.search(r"(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", match[2]) is None
    return (low < have or (low == have and final)) and have < high


@functools.cache  # (once it passed: a refusal is not cached, and ends the command anyway)
def check_version() -> None:
    """Refuse (exit 1) a checkpoint-engine these internals were not written for."""
    problem = version_problem()
    if problem is not None:
        raise OperationFailed(problem)


def _require(obj: Any, *names: str) -> Any:
    """The version check, then that `obj` has each of `names`: the first one's value."""
    check_version()
    for name in names:
        if not hasattr(obj, name):
            raise OperationFailed(
                f"{DISTRIBUTION} {installed_version()} has no {type(obj).__name__}.{name}, "
                f"which ckptctl relies on (it is written for {DISTRIBUTION}{WRITTEN_FOR})"
            )
    return getattr(obj, names[0])


def p2p_store(ps: Any) -> Any:
    """The ParameterServer's P2PStore, None when p2p did not start."""
    return _require(ps, "_p2p_store")


def device_uuid(ps: Any) -> str:
    return str(_require(ps, "_device_uuid"))


def start_socket_counter(ps: Any) -> None:
    """Start the count in the ParameterServer's zmq socket names at random: in the host's shared
    namespace, counted from 0 in every process, two jobs on one GPU would bind the same name
    (EADDRINUSE). The ranks still agree: every update all-reduces the largest count first."""
    import secrets

    _require(ps, "_zmq_addr_counter")
    ps._zmq_addr_counter = secrets.randbits(40) << 16  # room for 65536 updates


def wrap_socket_factory(ps: Any, wrap: Callable[[Any], Any]) -> None:
    """Make every zmq REQ socket the ParameterServer binds for an update pass through `wrap`."""
    bind = _require(ps, "_bind_zmq_socket")

    def bind_wrapped() -> tuple[Any, list[tuple[str, str]]]:
        socket, paths = bind()
        return wrap(socket), paths

    ps._bind_zmq_socket = bind_wrapped


# The signature of ParameterServer._copy_to_buffer that `wrap_bucket_copy` is written for.
BUCKET_COPY_PARAMETERS = ["checkpoint_name", "bucket", "buffer", "owner_rank"]


def wrap_bucket_copy(ps: Any, wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """Make the ParameterServer's copy of a bucket out of the registered host buffers (the one
    place an update reads them: into its H2D buffer, or straight into the IPC buffer) pass
    through `wrap(original)`. A copy of another signature is refused: a wrapper that
    misread its arguments would copy memory nobody checked."""
    original = _require(ps, "_copy_to_buffer", "_get_memory_pool")
    try:
        params: list[str] | None = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = None
    if params != BUCKET_COPY_PARAMETERS:
        raise OperationFailed(
            f"{DISTRIBUTION} {installed_version()}'s ParameterServer._copy_to_buffer takes "
            f"{params}, not ({', '.join(BUCKET_COPY_PARAMETERS)}): a push cannot overlap its "
            f"read with the transfer (ckptctl is written for {DISTRIBUTION}{WRITTEN_FOR})"
        )
    ps._copy_to_buffer = wrap(original)


def add_checkpoint(ps: Any, name: str, buffers: list[Any]) -> None:
    """Put `buffers` (MemoryBuffers) where register_checkpoint would have put them."""
    _require(ps, "_memory_pool", "_register_parameters_to_p2p_store", "_p2p_store")
    if name in ps._memory_pool:
        raise OperationFailed(f"checkpoint {name!r} is already registered")
    ps._memory_pool[name] = buffers
    if ps._p2p_store is not None:
        ps._register_parameters_to_p2p_store(name)


def registered_buffers(ps: Any, name: str) -> list[Any]:
    """The MemoryBuffers registered as `name` ([] for none)."""
    return list(_require(ps, "_memory_pool").get(name, []))


def forget_checkpoint(ps: Any, name: str) -> None:
    """Drop `name` from the pool without unpinning its buffers (they go back to ours)."""
    del _require(ps, "_memory_pool")[name]


def own_facts(ps: Any, name: str) -> dict[str, Any]:
    """What this rank adds to a shared plan for a planned gather: its buffers' addresses, sizes
    and tensor counts, its host, GPU and p2p store (what gather_metas sends)."""
    from ckptctl.ce.bare_import import engine_module

    own = _require(ps, "_memory_pool", "_p2p_store", "_device_uuid", "_rdma_device").get(name, [])
    return {
        "ptrs": [b.buffer.data_ptr() for b in own],
        "sizes": [b.size for b in own],
        "tensors": [len(b.metas) for b in own],
        "p2p_store_addr": None if ps._p2p_store is None else ps._p2p_store.addr,
        "host_ip": engine_module("device_utils").get_ip(),
        "device_uuid": ps._device_uuid,
        "rdma_device": ps._rdma_device or "",
    }


def apply_gathered(
    ps: Any, docs: list[dict[str, Any]], planned: dict[int, list[tuple[int, list[Any]]]]
) -> None:
    """Leave `ps` as gather_metas would, from every rank's `own_facts` (`docs`, in rank order)
    and the plan's buffers: the global metas (ranks without buffers left out), the hosts and
    GPU UUIDs (kept from the first gather), the RDMA topology. tests/torchrun/test_engine_internals.py
    runs gather_metas beside this and compares everything either sets."""
    from ckptctl.ce.bare_import import engine_module

    _require(ps, "_gpu_count", "_all_hosts", "_global_device_uuids", "_local_rdma_devices")
    types = engine_module("data_types")
    global_metas: dict[int, Any] = {}
    all_hosts: list[str] = []
    device_uuids: list[str] = []
    for rank, doc in enumerate(docs):
        buffers = planned.get(rank, [])
        sizes, counts = [size for size, _ in buffers], [len(metas) for _, metas in buffers]
        if doc["sizes"] != sizes or doc["tensors"] != counts:
            raise OperationFailed(
                f"rank {rank} registered buffers of {doc['sizes']} bytes, not the {sizes} this "
                "rank planned for it: the ranks run different ckptctl versions or see "
                "different checkpoints"
            )
        if rank % ps._gpu_count == 0 and not ps._all_hosts:
            all_hosts.append(doc["host_ip"])
        if not ps._global_device_uuids:
            device_uuids.append(doc["device_uuid"])
        if buffers:
            global_metas[rank] = types.MemoryBufferMetaList.model_construct(
                p2p_store_addr=doc["p2p_store_addr"],
                rdma_device=doc["rdma_device"],
                memory_buffer_metas_list=[
                    types.MemoryBufferMetas.model_construct(metas=metas, ptr=ptr, size=size)
                    for (size, metas), ptr in zip(buffers, doc["ptrs"], strict=True)
                ],
            )
        addr = doc["p2p_store_addr"]
        key = doc["rdma_device"] + "@" + addr.split(":")[0] if addr else doc["host_ip"]
        ps._local_rdma_devices[key].add(rank)
    ps._current_global_parameter_metas = global_metas
    if not ps._all_hosts:
        ps._all_hosts = all_hosts
    if not ps._global_device_uuids:
        ps._global_device_uuids = device_uuids
    ps._remote_rdma_devices = ps._local_rdma_devices.copy()
