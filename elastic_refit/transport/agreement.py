"""Plan agreement: every participant publishes its plan's fingerprint and checks all the
others' before a byte moves (DESIGN.md, invariant 4)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from elastic_refit.errors import PlanMismatch

__all__ = ["agree_on_plan"]


def agree_on_plan(store: dist.Store, fingerprint: str, *, me: str, participants: Sequence[str],
                  key: Callable[[str], str], wait: Callable[[list[str]], None] | None = None,
                  refused: Callable[[str, str], None] | None = None) -> None:
    """Publish ``fingerprint`` under ``key(me)``, wait for every participant's key (with
    ``wait(keys)``, default ``store.wait``) and raise :class:`PlanMismatch` naming the first
    participant whose value differs. A participant that could not plan publishes a marker
    instead of a fingerprint; ``refused(participant, value)`` sees such values first and
    may raise an error of its own."""
    if me not in participants:
        raise ValueError(f"{me!r} is not among the participants {list(participants)}")
    store.set(key(me), fingerprint)
    keys = [key(p) for p in participants]
    (wait or store.wait)(keys)
    for participant, theirs in zip(participants, store.multi_get(keys), strict=True):
        other = theirs.decode()
        if other != fingerprint:
            if refused is not None:
                refused(participant, other)
            raise PlanMismatch(f"{me} planned {fingerprint} but {participant} planned {other}")
