"""The communicator libraries a transport can run on (no torch: configs and plans name them)."""

from __future__ import annotations

import enum


class Backend(enum.StrEnum):
    """The communicator library behind a transport."""

    GLOO = "gloo"  # torch ProcessGroupGloo: CPU tensors; reconfiguration is always a rebuild
    NCCL = "nccl"  # torch ProcessGroupNCCL: one GPU per rank; shrink through shrink_group
    NCCL4PY = "nccl4py"  # communicators owned through nccl4py: shrink and grow

    @classmethod
    def parse(cls, value: str | Backend) -> Backend:
        """``value`` as a backend; ``ValueError`` naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(b.value for b in cls)
            raise ValueError(f"backend must be one of {choices}, got {value!r}") from None

    @property
    def device_type(self) -> str:
        return "cpu" if self is Backend.GLOO else "cuda"
