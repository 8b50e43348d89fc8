"""The runtime's named phases, and the one place hooks attach to them.

The runtime calls :meth:`PhaseHooks.fire` at each phase of :data:`PHASES` and passes every
epoch's transport through :meth:`PhaseHooks.wrap_transport`. With nothing installed both
cost one attribute test. The test toolkit (its ``faults`` module) installs hooks
here to inject faults at named phases and to wrap the transport in a fault-injecting one;
nothing patches runtime or transport methods.

Hooks are process-wide: a member process runs one ``ElasticRefit``; where several share a
process, ``context["member_id"]`` tells them apart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from elastic_refit.transport.protocol import Transport

__all__ = ["HOOKS", "PHASES", "PhaseHook", "PhaseHooks", "TransportWrapper"]

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


class PhaseHooks:
    """A registry of phase hooks and transport wrappers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: tuple[PhaseHook, ...] = ()
        self._wrappers: tuple[TransportWrapper, ...] = ()

    def install(self, hook: PhaseHook | None = None, *,
                wrap_transport: TransportWrapper | None = None) -> Callable[[], None]:
        """Add ``hook`` (called as ``hook(phase, context)``) and/or a transport wrapper;
        returns a function that removes them again."""
        if hook is None and wrap_transport is None:
            raise ValueError("install needs a hook, a transport wrapper, or both")
        with self._lock:
            if hook is not None:
                self._hooks += (hook,)
            if wrap_transport is not None:
                self._wrappers += (wrap_transport,)

        def uninstall() -> None:
            with self._lock:
                self._hooks = tuple(h for h in self._hooks if h is not hook)
                self._wrappers = tuple(w for w in self._wrappers if w is not wrap_transport)

        return uninstall

    def fire(self, phase: str, context: Mapping[str, Any]) -> None:
        """Run every hook for ``phase``; what a hook raises fails the phase (as a fault would)."""
        hooks = self._hooks
        if not hooks:
            return
        if phase not in PHASES:
            raise ValueError(f"unknown runtime phase {phase!r}; phases are {', '.join(PHASES)}")
        for hook in hooks:
            hook(phase, context)

    def wrap_transport(self, transport: Transport) -> Transport:
        """``transport`` passed through every installed wrapper, in install order."""
        for wrap in self._wrappers:
            transport = wrap(transport)
        return transport


#: The process-wide registry the runtime consults.
HOOKS = PhaseHooks()
