"""ckptctl: push safetensors checkpoints into running SGLang / vLLM servers over CUDA IPC."""

__version__ = "0.1.0"
