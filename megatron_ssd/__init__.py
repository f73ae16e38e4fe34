"""megatron-ssd: offload training activations to NVMe SSDs while the GPU computes."""

from .cache import StepStats, TensorCache
from .config import IOConfig, OffloadConfig, load_config
from .placement import LayerChoice, Placement
from .errors import ChecksumError, ConfigError, MegatronSSDError, OffloadIOError

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "ConfigError",
    "IOConfig",
    "LayerChoice",
    "MegatronSSDError",
    "OffloadConfig",
    "OffloadIOError",
    "Placement",
    "StepStats",
    "TensorCache",
    "load_config",
]
