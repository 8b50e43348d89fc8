"""What a refit's executor is told: its staging budget, verification, kernels, zero copy."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExecutorOptions", "MiB"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ExecutorOptions:
    """``staging_bytes`` bounds this rank's staging buffers; ``verify`` sends a digest of
    every box with the data and checks it on arrival; ``pack_backend`` picks the kernels.
    ``delta``: refits may send a bucket as its change against a base (``Executor.run``'s
    ``delta``); the messages that may carry one always pack (no zero copy), and two more
    staging buffers compare a bucket with its base."""

    staging_bytes: int = 256 * MiB
    verify: bool = False
    pack_backend: str = "auto"
    zero_copy: bool = True
    delta: bool = False

    def __post_init__(self) -> None:
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {self.staging_bytes}")
        if self.pack_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"pack_backend must be auto, torch or triton, got {self.pack_backend!r}")
