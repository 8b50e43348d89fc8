"""The runtime's named phases, and the hooks a context is given for them.

``ElasticRefit(..., hooks=PhaseHooks(...))`` calls :meth:`PhaseHooks.fire` at each phase of
:data:`PHASES` and passes every epoch's transport through :meth:`PhaseHooks.wrap_transport`.
The default, :data:`NO_HOOKS`, does nothing (one attribute test per phase). The test
toolkit (``elastic_refit.testing.faults.fault_hooks``) builds hooks that inject faults at
named phases and wrap the transport in a fault-injecting one; nothing patches runtime or
transport methods, and nothing is process-wide: each context has the hooks it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_refit.transport.protocol import Transport

__all__ = ["NO_HOOKS", "PHASES", "PhaseHook", "PhaseHooks", "TransportWrapper"]

#: Every phase the runtime fires, in the order one epoch meets them. Context fields (besides
#: member_id, role): comm.* -> epoch (and rank, path once ready); the attempt phases ->
#: epoch, seq, version; transfer.before also the executor and the epoch's transport.
PHASES: tuple[str, ...] = (
    "comm.reconfiguring",  # a new epoch was seen; the communicator is about to change
    "comm.ready",  # the epoch's communicator is formed
    "attempt.start",  # this rank starts an attempt (before planning)
    "plan.agreed",  # every participant planned the same fingerprint
    "transfer.before",  # buffers resolved; the executor is about to move bytes
    "ack.before",  # the transfer verified; this inference rank is about to ack
    "commit.before",  # the coordinator is about to commit a version
)

PhaseHook = Callable[[str, Mapping[str, Any]], None]
TransportWrapper = Callable[[Transport], Transport]


@dataclass(frozen=True, slots=True)
class PhaseHooks:
    """Phase hooks (each called as ``hook(phase, context)``) and transport wrappers (each
    ``wrap(transport) -> transport``, applied in order), given to one ``ElasticRefit``."""

    hooks: tuple[PhaseHook, ...] = ()
    wrappers: tuple[TransportWrapper, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hooks", "wrappers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(callable(f) for f in value):
                raise ValueError(f"PhaseHooks.{name} must be a tuple of callables, got {value!r}")

    def fire(self, phase: str, context: Mapping[str, Any]) -> None:
        """Run every hook for ``phase``; what a hook raises fails the phase (as a fault would)."""
        if not self.hooks:
            return
        if phase not in PHASES:
            raise ValueError(f"unknown runtime phase {phase!r}; phases are {', '.join(PHASES)}")
        for hook in self.hooks:
            hook(phase, context)

    def wrap_transport(self, transport: Transport) -> Transport:
        """``transport`` passed through every wrapper, in order."""
        for wrap in self.wrappers:
            transport = wrap(transport)
        return transport


#: Hooks that do nothing: what a context has unless it is given others.
NO_HOOKS = PhaseHooks()
