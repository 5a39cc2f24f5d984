"""Single-device model code; parallelism is applied from outside (see moebench.parallel)."""

from moebench.model.transformer import Transformer, build_model

__all__ = ["Transformer", "build_model"]
