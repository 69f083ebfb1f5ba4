"""What ckptctl relies on inside checkpoint-engine (pinned >=0.4.2,<0.5), checked on CPU, so
that a release that changes it fails here rather than in an update on a GPU node:

- its package imports without the HTTP API (ce/bare_import.py), for metas files too;
- the fields of the models we build without validation (host_memory MetaMaker, model_construct);
- the state its gather_metas leaves in a ParameterServer, which `apply_gathered` must leave
  exactly the same way: both run side by side over a real (gloo) process group of 2 torchrun
  ranks, on the same registered buffers, and everything they set is compared.
"""

from __future__ import annotations

import inspect
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_factory import mixed_tensors, write_real_checkpoint
from warm_launch import torchrun_cmd

from ckptctl.ce.bare_import import engine_module
from ckptctl.checkpoint import plan_split, read_checkpoint
from ckptctl.checkpoint.loader import torch_layout
from ckptctl.transfer.host_memory import _file_reads, _share_reader

REPO = Path(__file__).resolve().parent.parent


def test_the_parameter_server_imports_without_the_http_api() -> None:
    code = """
    import sys
    from ckptctl.ce.bare_import import engine_module, is_bare
    ps = engine_module("ps")
    engine_module("data_types"), engine_module("device_utils")
    assert is_bare(), "the package's __init__ ran"
    heavy = [m for m in ("fastapi", "starlette", "uvicorn", "checkpoint_engine.api")
             if m in sys.modules]
    assert not heavy, f"imported anyway: {heavy}"
    # Whoever wants the whole package still gets it, on first use:
    from checkpoint_engine import ParameterServer, __version__
    assert ParameterServer is ps.ParameterServer and __version__
    assert not is_bare() and "checkpoint_engine.api" in sys.modules
    import checkpoint_engine
    assert "update_weights_from_ipc" in checkpoint_engine.__all__
    print("ok")
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.parametrize("operation", ["read", "read-legacy", "write"])
def test_metas_files_are_read_and_written_without_the_http_api(
    operation: str, tmp_path: Path
) -> None:
    """inspect-metas, join and --load-metas-file start a third of a second sooner: a metas
    file, and a legacy pickle, are read (and one written) with the package still bare. Each in
    a process of its own: the first to enter the package bare would hide the others."""
    from metas_samples import small_metas, write_small_metas

    metas_file = write_small_metas(tmp_path)
    pickled = tmp_path / "metas.pkl"
    pickled.write_bytes(pickle.dumps(small_metas()))
    calls = {
        "read": f"read_metas_file({str(metas_file)!r})",
        "read-legacy": f"read_metas_file({str(pickled)!r}, allow_pickle=True)",
        "write": f"write_metas_file({str(tmp_path / 'again.json')!r}, {{}}, checkpoint_name='x',"
        " world_size=1)",
    }
    code = f"""
    import sys
    from ckptctl.ce.bare_import import is_bare
    from ckptctl.metas import read_metas_file, write_metas_file
    {calls[operation]}
    heavy = [m for m in ("fastapi", "checkpoint_engine.api") if m in sys.modules]
    assert is_bare() and not heavy, f"imported anyway: {{heavy}}"
    assert "checkpoint_engine.data_types" in sys.modules
    print("ok")
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_missing_name_is_an_attribute_error_after_the_package_loads() -> None:
    code = """
    from ckptctl.ce.bare_import import engine_module
    engine_module("ps")
    import checkpoint_engine
    try:
        checkpoint_engine.no_such_thing
    except AttributeError as exc:
        print("AttributeError", "no_such_thing" in str(exc))
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.stdout.split() == ["AttributeError", "True"], r.stderr[-3000:]


def test_the_models_have_the_fields_we_build_them_with() -> None:
    types = engine_module("data_types")
    assert set(types.ParameterMeta.model_fields) == {"name", "dtype", "shape", "aligned_size"}
    assert set(types.MemoryBuffer.model_fields) == {"buffer", "size", "metas", "manually_pinned"}
    assert set(types.MemoryBufferMetas.model_fields) == {"metas", "ptr", "size"}
    assert set(types.MemoryBufferMetaList.model_fields) == {
        "p2p_store_addr",
        "memory_buffer_metas_list",
        "rdma_device",
    }
    assert engine_module("pin_memory")._ALIGN_SIZE == _file_reads.ALIGN
    ps = engine_module("ps").ParameterServer
    assert list(inspect.signature(ps.gather_metas).parameters) == ["self", "checkpoint_name"]
    assert callable(ps._bind_zmq_socket) and callable(ps._register_parameters_to_p2p_store)
    # unique_socket_counter: the socket names count from `_zmq_addr_counter`, which every
    # update all-reduces to the ranks' largest before naming anything.
    assert "self._zmq_addr_counter" in inspect.getsource(ps._bind_zmq_socket)
    detect = inspect.getsource(ps._detect_bucket_size)
    assert "-self._zmq_addr_counter" in detect and "ReduceOp.MIN" in detect


def test_fast_metas_equal_validated_ones_for_every_dtype(tmp_path: Path) -> None:
    """MetaMaker skips pydantic's validation (10 us a tensor): what it makes must be what
    validation makes - equal, dumped alike, pickled alike - and equal shapes share one
    torch.Size (one pickle memo entry per shape in every bucket sent to the server)."""
    tensors = mixed_tensors(seed=4) | {f"same.{i}": torch.zeros(3, 5) for i in range(4)}
    ckpt = read_checkpoint(write_real_checkpoint(tmp_path / "ck", [tensors]))
    (bucket,) = _file_reads.layout(ckpt.tensors)
    fast = _share_reader.MetaMaker()(bucket)
    meta_cls = engine_module("data_types").ParameterMeta
    for meta, (t, _) in zip(fast, bucket.placed, strict=True):
        dtype, shape = torch_layout(t)
        slow = meta_cls(
            name=t.name, dtype=dtype, shape=list(shape), aligned_size=_file_reads.aligned(t.nbytes)
        )
        assert meta == slow and meta.model_dump() == slow.model_dump()
        assert meta.model_dump_json() == slow.model_dump_json()
        assert pickle.loads(pickle.dumps(meta)) == slow
        assert type(meta.shape) is torch.Size
    same = [m.shape for m in fast if m.name.startswith("same.")]
    assert all(s is same[0] for s in same)


GATHER_RANK = r"""
import json, os, sys
from collections import defaultdict
import torch.distributed as dist
from ckptctl.checkpoint import plan_split, read_checkpoint
from ckptctl.launch import launch_info
from ckptctl.ce import internals as ce_internals
from ckptctl.transfer import host_memory
from ckptctl.ce.session import all_gather_json
from ckptctl.job.coordination import Coordinator
from ckptctl.ce.bare_import import engine_module
from ckptctl.job.process_group import BackgroundProcessGroup

ckpt, split, gpu_count, p2p = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "p2p"
launch = launch_info()
coordinator = Coordinator.connect(launch, timeout_s=60)
group = BackgroundProcessGroup(rank=launch.rank, world_size=launch.world_size,
                               store=coordinator.store, backend="gloo")
group.wait(60)
checkpoint = read_checkpoint(ckpt)
plan = plan_split(checkpoint, launch.world_size, split)
reader = host_memory.ShareReader(checkpoint, plan.ranks[launch.rank].tensors, pin=False, plan=plan,
                             rank=launch.rank)
buffers = reader.result()
PS = engine_module("ps").ParameterServer


class P2PStore:
    addr = f"10.0.0.{launch.rank}:1700{launch.rank}"


store = P2PStore() if p2p else None


def bare():
    # What ParameterServer.__init__ sets and gather_metas reads (it needs CUDA to run).
    ps = object.__new__(PS)
    ps._rank, ps._world_size, ps._gpu_count = launch.rank, launch.world_size, gpu_count
    ps._local_rank = launch.rank % gpu_count
    ps._auto_pg = False
    ps._all_hosts, ps._global_device_uuids = [], []
    ps._local_rdma_devices, ps._remote_rdma_devices = defaultdict(set), defaultdict(set)
    ps._current_shared_memory_pool_user = ""
    ps._memory_pool = {PS.shared_memory_pool_name: [], "ck": buffers}
    ps._current_global_parameter_metas = {}
    ps._p2p_store = store
    ps._rdma_device = "mlx5_0" if p2p else None
    ps._device_uuid = f"GPU-{launch.rank}"
    return ps


theirs, ours = bare(), bare()
rounds = []
for _ in range(2):  # the second gather keeps the first one's hosts and GPU UUIDs
    theirs.gather_metas("ck")
    ce_internals.apply_gathered(
        ours, all_gather_json(ce_internals.own_facts(ours, "ck")),
        reader.planned,
    )
    a, b = vars(theirs), vars(ours)
    rounds.append({
        "same_keys": sorted(a) == sorted(b),
        "differ": sorted(k for k in a if a[k] != b.get(k)),
        "owners": sorted(b["_current_global_parameter_metas"]),
        "dumps_equal": all(
            a["_current_global_parameter_metas"][r].model_dump()
            == b["_current_global_parameter_metas"][r].model_dump()
            for r in a["_current_global_parameter_metas"]
        ),
        "tensors": sum(len(m.metas) for e in b["_current_global_parameter_metas"].values()
                       for m in e.memory_buffer_metas_list),
    })
os.write(1, (json.dumps({"rank": launch.rank, "rounds": rounds}) + "\n").encode())
from ckptctl import results
results.leave_group_to_exit(0)
"""


@pytest.fixture
def ckpt(mixed_checkpoint: Path) -> Path:
    return mixed_checkpoint


@pytest.mark.slow
@pytest.mark.parametrize(
    ("split", "gpu_count", "p2p"),
    [("tensors", 2, "off"), ("files", 1, "p2p"), ("auto", 1, "off")],
)
def test_planned_gather_leaves_the_parameter_server_as_its_own_gather_does(
    ckpt: Path, tmp_path: Path, split: str, gpu_count: int, p2p: str
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(GATHER_RANK)
    r = subprocess.run(
        torchrun_cmd(str(script), str(ckpt), split, str(gpu_count), p2p, nproc=2),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    docs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert sorted(d["rank"] for d in docs) == [0, 1]
    total = len(read_checkpoint(ckpt).tensors)
    for doc in docs:
        for rnd in doc["rounds"]:
            assert rnd["same_keys"] and rnd["differ"] == [], rnd
            assert rnd["dumps_equal"] and rnd["tensors"] == total


def test_a_rank_whose_buffers_differ_from_its_plan_is_refused(ckpt: Path) -> None:
    """The sizes travel with the addresses: a rank that laid out its share differently (another
    ckptctl version) is an error, not a silently wrong transfer."""
    from collections import defaultdict

    from ckptctl.ce.internals import apply_gathered
    from ckptctl.errors import OperationFailed

    checkpoint = read_checkpoint(ckpt)
    planned = _share_reader.planned_buffers(plan_split(checkpoint, 2, "tensors"))
    ps = object.__new__(engine_module("ps").ParameterServer)
    ps._gpu_count, ps._all_hosts, ps._global_device_uuids = 1, [], []
    ps._local_rdma_devices = defaultdict(set)
    doc = {"p2p_store_addr": None, "host_ip": "h", "device_uuid": "GPU-x", "rdma_device": ""}
    docs = [
        {**doc, "ptrs": [1], "sizes": [planned[0][0][0]], "tensors": [len(planned[0][0][1])]},
        {**doc, "ptrs": [2], "sizes": [planned[1][0][0] + 256], "tensors": [1]},
    ]
    with pytest.raises(OperationFailed, match="rank 1 registered buffers"):
        apply_gathered(ps, docs, planned)
