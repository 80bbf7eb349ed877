"""The GPU worker: the mlx-lm model with dense weights only, routed experts leased from slots."""

from gpuworker.streamed import ExpertParam, ExpertProvider, ExpertProviderError, LeasedWave, StreamedSwitch

__all__ = ["ExpertParam", "ExpertProvider", "ExpertProviderError", "LeasedWave", "StreamedSwitch"]
