"""checkpoint-engine's ParameterServer, with its known traps disarmed: mooncake kept out of
broadcast and checked for p2p, every worker reply seen and every wait bounded, a failed push
ended without ending the process, and checkpoint files never handed over for deletion.

    session = ParameterServerSession(p2p=P2P.off, io_timeout=lambda: 60.0)
    session.register(name, named_tensors); session.gather(name); session.update(name, req, None)
"""

from ckptctl.ce.p2p import p2p_missing
from ckptctl.ce.session import ParameterServerSession, buffer_views

__all__ = ["ParameterServerSession", "buffer_views", "p2p_missing"]
