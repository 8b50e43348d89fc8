"""Fault injectors for multi-process executor tests (picklable, applied in the child)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class FailAfterSends:
    """On rank ``rank``, the ``after``-th send raises (``mode="raise"``) or the process
    SIGKILLs itself (``mode="kill"``) mid-transfer."""

    rank: int
    after: int
    mode: str = "raise"

    def __call__(self, group, executor) -> None:
        if group.rank != self.rank:
            return
        original = group.send
        count = {"sends": 0}

        def send(tensor, peer, tag=0):
            count["sends"] += 1
            if count["sends"] > self.after:
                if self.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure on rank {self.rank} at send {count['sends']}")
            return original(tensor, peer, tag)

        group.send = send


@dataclass(frozen=True)
class CorruptFirstPack:
    """On rank ``rank``, flip one byte of the first packed bucket after packing (as a
    faulty link or kernel would), so the receiver's digest check must catch it."""

    rank: int

    def __call__(self, group, executor) -> None:
        if group.rank != self.rank:
            return
        done = {"flipped": False}
        for io in executor._io.values():  # fault injection reaches into the executor on purpose
            original = io.pack

            def pack(tensors, staging, verify, _original=original):
                _original(tensors, staging, verify)
                if not done["flipped"]:
                    staging[0] ^= 0xFF
                    done["flipped"] = True

            io.pack = pack
