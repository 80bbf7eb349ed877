"""The GPU worker: the mlx-lm model with dense weights only, routed experts leased from slots."""

from gpuworker.expert_provider import ExpertProvider, ExpertProviderError, LeasedWave
from gpuworker.streamed import ExpertParam, StreamedSwitch

__all__ = ["ExpertParam", "ExpertProvider", "ExpertProviderError", "LeasedWave", "StreamedSwitch"]
