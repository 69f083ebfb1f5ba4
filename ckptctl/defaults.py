"""Names and defaults shared by the CLI and the library (no imports: the CLI starts fast)."""

DEFAULT_ENDPOINT = "http://localhost:19730"  # the seed script's default
API_KEY_ENV = "CKPTCTL_API_KEY"  # where --api-key is read from when not given
# Flags that scripts repeat on every call can come from the environment instead (shown in --help).
ENDPOINT_ENV = "CKPTCTL_ENDPOINT"
UDS_ENV = "CKPTCTL_UDS"
ENGINE_ENV = "CKPTCTL_ENGINE"
CONTROL_SOCKET_ENV = "CKPTCTL_CONTROL_SOCKET"
# Where serve jobs put their default control sockets and clients look for them, instead of
# $XDG_RUNTIME_DIR/ckptctl/ and /tmp/ckptctl-<uid>/ (serve/control.py).
SOCKET_DIR_ENV = "CKPTCTL_SOCKET_DIR"
DEFAULT_CHECKPOINT_NAME = "my-checkpoint-iter-0"  # the seed script's --checkpoint-name
PUSH_LOG_SIZE = 1000  # how many pushes `ckptctl status --history` lists (the latest)
