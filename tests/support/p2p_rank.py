"""Run the real `ckptctl` CLI with checkpoint-engine's p2p store on mooncake's TCP transport,
on loopback. For the p2p GPU tests only (tests/gpu/test_gpu_p2p.py); never the product's path.

    PS_P2P_STORE_RDMA_DEVICES=tcp MC_FORCE_TCP=1 torchrun ... tests/support/p2p_rank.py join ...

What makes p2p run without an RDMA NIC, and where it is set:
- the environment (`P2P_TCP_ENV`, set by the test on the torchrun command):
  PS_P2P_STORE_RDMA_DEVICES names the "RDMA device" checkpoint-engine's `rdma_device(rank)`
  returns (it lists the devices from this variable before it asks libibverbs), so P2PStore
  starts and the metas carry a device name, which `join` and `load_metas` insist on; it also
  satisfies ckptctl's `p2p_missing()`. mooncake-transfer-engine (0.3.x) ignores the protocol
  argument of `initialize` and installs its TCP transport when it finds no HCA, or whenever
  MC_FORCE_TCP is set.
- here: checkpoint-engine's `get_ip()` (the address P2PStore registers and the metas carry)
  asks the routing table for a route to a public address; in the tests every p2p address is
  127.0.0.1 instead.

tests/torchrun/test_p2p_cpu.py checks that checkpoint-engine still works this way.
"""

from __future__ import annotations

import sys

# What the test job's environment must hold (the test puts it on every torchrun command).
P2P_TCP_ENV = {"PS_P2P_STORE_RDMA_DEVICES": "tcp", "MC_FORCE_TCP": "1"}
LOOPBACK = "127.0.0.1"


def loopback_get_ip() -> str:
    return LOOPBACK


def use_loopback() -> None:
    """Point checkpoint-engine's address look-up at loopback, in every module that imported it."""
    import checkpoint_engine.device_utils as device_utils
    import checkpoint_engine.p2p_store as p2p_store
    import checkpoint_engine.ps as ps

    for module in (device_utils, p2p_store, ps):
        if not callable(getattr(module, "get_ip", None)):
            raise SystemExit(f"p2p_rank.py: {module.__name__} has no get_ip any more")
        module.get_ip = loopback_get_ip  # type: ignore[attr-defined]


if __name__ == "__main__":
    import os

    missing = {k: v for k, v in P2P_TCP_ENV.items() if os.environ.get(k) != v}
    if missing:
        raise SystemExit(f"p2p_rank.py: set {missing} in the job's environment")
    use_loopback()
    sys.argv = ["ckptctl", *sys.argv[1:]]
    from ckptctl.cli import main

    main()
