"""A long-lived job's per-push store keys (issue 23 item 6): each rank deletes the keys it wrote
in a push's scope once every rank is past that push, so the store does not grow with pushes."""

from __future__ import annotations

import threading

from ckptctl.job.coordination import Coordinator
from ckptctl.launch import LaunchInfo


def _ranks() -> tuple[Coordinator, Coordinator]:
    """Two ranks' coordinators on one real TCPStore (as torchrun's ranks share its store)."""
    rank0 = Coordinator.local(LaunchInfo(rank=0, world_size=2, local_world_size=2))
    launch1 = LaunchInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)
    return rank0, Coordinator(rank0.store, launch1)


def _push(ranks: tuple[Coordinator, ...], seq: int) -> list[Coordinator]:
    """What a push writes on every rank: a published document, a barrier, an abort."""
    views = [c.scoped(f"push{seq}") for c in ranks]
    threads = []
    for view in views:
        view.publish("plan", {"fingerprint": "x"})
        threads.append(threading.Thread(target=view.barrier, args=("pushed", 30)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    for view in views:
        view.publish_abort(1, f"rank {view.launch.rank} gave up")
    return views


def test_every_rank_deletes_its_keys_of_a_finished_push_and_no_other() -> None:
    rank0, rank1 = _ranks()
    first = _push((rank0, rank1), 1)
    _push((rank0, rank1), 2)
    keys = rank0.store.list_keys()
    assert sum("push1/" in k for k in keys) == 5, keys  # plan and pushed per rank, one abort
    assert rank0.drop_scope("push1") == 3  # its plan, its barrier key, the abort it won
    assert rank1.drop_scope("push1") == 2  # the abort is gone already
    keys = rank0.store.list_keys()
    assert not [k for k in keys if "push1/" in k], keys
    assert sum("push2/" in k for k in keys) == 5, keys  # the next push's keys are kept
    # A thread of the finished push that fails late writes nothing any more.
    first[1].publish_abort(1, "late")
    assert first[1].aborted() is None
    assert rank0.drop_scope("push1") == 0  # once only
