"""Fast crash detection: suspicions with refutation, and a liveness ring for idle members.

A lease TTL bounds how long a dead member can look alive, but a killed process is visible
much sooner: the kernel closes its sockets, so every TCP connection to it ends at once
(EOF or reset) and a new one is refused. This module turns that evidence into a decision
without ever trusting it for safety (SWIM-style suspicion, with fencing):

1. A member that sees such evidence about a peer *reports a suspicion*: it creates
   ``health/suspects/{member_id}`` (on its own lease) naming the suspect's lease.
2. The suspect, if alive, *refutes* it: its membership loop (not the agent thread, which
   may be busy) deletes the key, guarded by its own lease. Nothing else changes: a
   refuted member keeps its lease, incarnation and place in the epoch.
3. Unrefuted after ``refute_window_s`` -- or at once, if the confirmer's own check of the
   evidence agrees (the suspect's listener refuses it too: a second, independent
   observation, as Lifeguard's SWIM extensions use) -- the *confirmer* fences the suspect: one
   transaction deletes the suspect's member key and the suspicion, only if the suspicion
   is the same one (create revision) and the member key still sits on the suspected lease
   -- so a refutation and a confirmation can never both succeed -- then it revokes the
   suspect's lease (which frees the ``leader`` key too, if the suspect led). A fenced
   suspect that was alive after all finds its key gone, is *lost*, and must rejoin as a
   new incarnation: a false suspicion costs a rejoin, never a torn model.

The confirmer is the leader, unless the suspect holds the ``leader`` key itself (or there
is no leader): then the reporter confirms, so a leader killed mid-refit is replaced as
fast as any other member. The leader publishes the epoch without the fenced member at
once (no debounce for confirmed deaths).

Only evidence of a *dead* process may start this: a connection that ended without the
peer's goodbye, a reset, a refused connect, NCCL's "remote process exited". Timeouts
never do: a stopped (SIGSTOP) or slow process keeps its sockets open, cannot refute, and
so keeps the lease TTL as its bound.

Idle members (no transfer touching them) are covered by the *liveness ring*: each member
listens on one TCP port (``probe`` in its record) and keeps one connection to its
successor in member-key order, so every member is watched by its two neighbours with two
connections per member, no etcd traffic at all until something dies, and nothing per pair.
Members say goodbye (one byte) before closing a ring connection on purpose (leaving, the
ring moved): only a connection that ends without it is evidence.

The decisions (:func:`decide_suspicions`, :func:`ring_successor`,
:func:`dead_peer_evidence`) are pure, with the clock passed in; the side effects live in
:class:`~elastic_refit.membership.service.Membership` and :class:`LivenessRing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "EVIDENCE_KINDS",
    "LivenessRing",
    "RingPeer",
    "Suspicion",
    "SuspicionDecision",
    "dead_peer_evidence",
    "decide_suspicions",
    "probe_dead",
    "reachable_probe",
    "ring_successor",
]

# closed: a connection ended (EOF) without the peer's goodbye; reset: ECONNRESET / EPIPE;
# refused: nobody listens on the peer's port any more; remote: NCCL says the remote process
# exited.
EVIDENCE_KINDS = ("closed", "reset", "refused", "remote")
BYE = b"B"
_HELLO_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 1.0

# Lower-case fragments of transport errors, first match wins. A timeout is never evidence
# (a stopped or slow peer times out too); it is checked before anything else.
_NOT_EVIDENCE = ("timed out", "timeout", "deadline", "aborted transport", "superseded")
_EVIDENCE = (
    ("connection reset", "reset"),
    ("broken pipe", "reset"),
    ("econnreset", "reset"),
    ("epipe", "reset"),
    ("connection refused", "refused"),
    ("econnrefused", "refused"),
    ("closed by peer", "closed"),
    ("connection closed", "closed"),
    ("remote process exited", "remote"),
    ("ncclremoteerror", "remote"),
)


def dead_peer_evidence(message: str) -> str | None:
    """The evidence kind (one of :data:`EVIDENCE_KINDS`) that a transport failure
    ``message`` gives of its peer's death, or ``None`` when it is no such evidence (a
    timeout, our own abort, anything unrecognised)."""
    text = message.lower()
    if any(fragment in text for fragment in _NOT_EVIDENCE):
        return None
    for fragment, kind in _EVIDENCE:
        if fragment in text:
            return kind
    return None


@dataclass(frozen=True, slots=True)
class Suspicion:
    """What ``health/suspects/{suspect}`` holds: ``reporter`` saw ``evidence`` that the
    incarnation of ``suspect`` on lease ``lease`` died. ``revision`` is the key's create
    revision (0 before it is written): a confirmation names exactly this suspicion."""

    suspect: str
    role: str
    lease: int
    incarnation: str
    reporter: str
    reporter_lease: int
    evidence: str
    detail: str = ""
    revision: int = 0

    def __post_init__(self) -> None:
        if self.evidence not in EVIDENCE_KINDS:
            raise ValueError(f"evidence must be one of {EVIDENCE_KINDS}, got {self.evidence!r}")
        if self.lease <= 0 or self.reporter_lease <= 0:
            raise ValueError(f"leases must be > 0, got lease={self.lease}, reporter_lease={self.reporter_lease}")

    def encode(self) -> bytes:
        return json.dumps({"suspect": self.suspect, "role": self.role, "lease": self.lease,
                           "incarnation": self.incarnation, "reporter": self.reporter,
                           "reporter_lease": self.reporter_lease, "evidence": self.evidence,
                           "detail": self.detail[:300]}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, revision: int = 0) -> Suspicion:
        d = json.loads(raw)
        return cls(str(d["suspect"]), str(d["role"]), int(d["lease"]), str(d["incarnation"]),
                   str(d["reporter"]), int(d["reporter_lease"]), str(d["evidence"]),
                   str(d.get("detail", "")), revision)


@dataclass(frozen=True, slots=True)
class SuspicionDecision:
    """What one member must do now about the suspicions in its control snapshot.

    ``refute``: suspicions of this member's own incarnation (delete them, now);
    ``confirm``: suspicions this member confirms (fence the suspect), their window over;
    ``drop``: suspicions this member confirms that went stale (the suspect's key is gone or
    belongs to another lease: nothing to fence, just delete them);
    ``pending``: suspicions this member confirms, their window still running (check
    their evidence: a verified one is confirmed at once);
    ``wake_in_s``: when the next pending window ends (None: nothing pending);
    ``seen``: when each pending suspicion was first seen, to pass to the next call."""

    refute: tuple[Suspicion, ...] = ()
    confirm: tuple[Suspicion, ...] = ()
    drop: tuple[Suspicion, ...] = ()
    pending: tuple[Suspicion, ...] = ()
    wake_in_s: float | None = None
    seen: Mapping[tuple[str, int], float] | None = None


def decide_suspicions(now: float, suspicions: Iterable[Suspicion], seen: Mapping[tuple[str, int], float], *,
                      my_lease: int, member_leases: Mapping[str, int], leader_lease: int | None,
                      refute_window_s: float,
                      verified: frozenset[tuple[str, int]] = frozenset()) -> SuspicionDecision:
    """Decide, at monotonic time ``now``, what the member on lease ``my_lease`` does about
    ``suspicions``.

    ``member_leases``: member id -> lease of its member key, as the snapshot has it;
    ``leader_lease``: the lease the ``leader`` key sits on (None: no leader);
    ``seen``: (suspect, revision) -> when this member first saw that suspicion (its own
    clock: no clock is compared across hosts). A suspicion's window runs from the moment its
    confirmer first saw it, so a confirmer that just took over waits a full window again;
    ``verified``: (suspect, revision) of suspicions whose evidence this member checked
    itself and found true (the suspect's listener refused it): confirmed without waiting.
    """
    if refute_window_s <= 0:
        raise ValueError(f"refute_window_s must be > 0, got {refute_window_s}")
    refute, confirm, drop, pending = [], [], [], []
    next_seen: dict[tuple[str, int], float] = {}
    wake: float | None = None
    for s in suspicions:
        if s.lease == my_lease:
            refute.append(s)  # alive enough to read it: say so, whatever the window
            continue
        leader_is_other = leader_lease not in (None, 0, s.lease)
        confirmer = leader_lease if leader_is_other else s.reporter_lease
        if confirmer != my_lease:
            continue
        if member_leases.get(s.suspect) != s.lease:
            drop.append(s)  # that incarnation is gone already (left, expired, replaced)
            continue
        key = (s.suspect, s.revision)
        first = seen.get(key, now)
        next_seen[key] = first
        left = first + refute_window_s - now
        if left <= 0 or key in verified:
            confirm.append(s)
        else:
            pending.append(s)
            wake = left if wake is None else min(wake, left)
    return SuspicionDecision(tuple(refute), tuple(confirm), tuple(drop), tuple(pending), wake, next_seen)


@dataclass(frozen=True, slots=True)
class RingPeer:
    """A member the ring may watch: its member key, id, lease, probe and host."""

    key: str
    member_id: str
    lease: int
    probe: str
    host: str


def reachable_probe(probe: str, peer_host: str, my_host: str) -> bool:
    """Whether a peer's ``probe`` (``host:port``) can be reached from this member: a
    loopback address only from the same host (it would reach *our* host's loopback and be
    refused, which reads as a death)."""
    host, sep, port = probe.rpartition(":")
    if not sep or not host or not port.isdigit():
        return False
    host = host.strip("[]")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return peer_host == my_host
    return host != "localhost" or peer_host == my_host


def ring_successor(my_key: str, peers: Iterable[RingPeer], my_host: str) -> RingPeer | None:
    """The peer this member watches: the next reachable member after ``my_key`` in key
    order, wrapping around (None when alone). Every member computes the same ring from the
    same snapshot, so each is watched by its predecessor (and watches it back through the
    same connection)."""
    candidates = sorted((p for p in peers if p.key != my_key and reachable_probe(p.probe, p.host, my_host)),
                        key=lambda p: p.key)
    if not candidates:
        return None
    for p in candidates:
        if p.key > my_key:
            return p
    return candidates[0]


# ---- side effects (asyncio, on the etcd client's loop) --------------------------------------
async def probe_dead(probe: str, *, settle_s: float = 0.05, connect_timeout_s: float = 0.5) -> str | None:
    """Check evidence before reporting it: connect to a suspect's liveness listener.

    Returns ``"refused"`` (nobody listens: the process is gone) or ``"reset"`` / ``"closed"``
    (accepted by the kernel, then dropped within ``settle_s``: the listener closed as the
    process died), else ``None``: the listener holds the connection, so the process exists
    -- alive, slow or stopped (a stopped process's kernel still accepts) -- and nothing may
    be reported. An unreachable host is ``None`` too: the TTL stays its bound."""
    host, _, port = probe.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)),
                                                connect_timeout_s)
    except ConnectionRefusedError:
        return "refused"
    except (TimeoutError, OSError, ValueError):
        return None
    try:
        data = await asyncio.wait_for(reader.read(1), settle_s)
        return "closed" if not data else None
    except TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except OSError:
        return None
    finally:
        with contextlib.suppress(Exception):
            writer.close()



DeathCallback = Callable[[str, int, str, str], None]  # (member_id, lease, evidence, detail)


class _Link:
    """One ring connection: its writer (to say goodbye) and the task reading it."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task | None = None
        self.leaving = False  # we close it on purpose: its end is no evidence


class LivenessRing:
    """This member's end of the liveness ring: a listener that peers connect to, and one
    connection to its successor. ``on_dead(member_id, lease, evidence, detail)`` runs on
    the loop when a ring connection ends without a goodbye or a connect is refused."""

    def __init__(self, host: str, member_id: str, lease: int, incarnation: str, on_dead: DeathCallback,
                 log) -> None:
        self.host = host
        self.hello = json.dumps({"member_id": member_id, "lease": lease, "incarnation": incarnation}).encode() + b"\n"
        self.on_dead = on_dead
        self.log = log
        self.address = ""
        self._server: asyncio.AbstractServer | None = None
        self._incoming: set[_Link] = set()
        self._successor: RingPeer | None = None
        self._out: _Link | None = None
        self._closing = False

    async def start(self) -> str:
        """Listen on a free port of ``host``; returns ``host:port`` (the record's probe)."""
        self._server = await asyncio.start_server(self._accepted, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"{host}:{port}"
        return self.address

    def follow(self, peer: RingPeer | None) -> None:
        """Watch ``peer`` from now on (loop thread); a change says goodbye to the old one."""
        if self._closing or peer == self._successor:
            return
        old, self._out, self._successor = self._out, None, peer
        if old is not None:
            self._leave(old)
        if peer is not None:
            link = _Link()
            link.task = asyncio.ensure_future(self._follow(peer, link))
            self._out = link

    async def aclose(self) -> None:
        """Say goodbye on every connection and stop listening (after the lease is revoked,
        so that no goodbye-less end can be read as this member's death while it is still
        a member)."""
        self._closing = True
        links = list(self._incoming) + ([self._out] if self._out is not None else [])
        for link in links:
            self._leave(link)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        tasks = [link.task for link in links if link.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    # ---- internals
    def _leave(self, link: _Link) -> None:
        link.leaving = True
        if link.writer is not None:
            with contextlib.suppress(Exception):
                link.writer.write(BYE)
                link.writer.close()
        if link.task is not None:
            link.task.cancel()

    async def _watch(self, reader: asyncio.StreamReader, link: _Link, member_id: str, lease: int) -> None:
        """Read until the peer's goodbye or the connection's end; the end without a goodbye
        is evidence of death."""
        evidence, detail = "closed", "ring connection ended without goodbye"
        try:
            while True:
                data = await reader.read(64)
                if not data:
                    break
                if BYE in data:
                    return
        except (ConnectionResetError, BrokenPipeError) as exc:
            evidence, detail = "reset", f"ring connection reset: {exc}"
        if not link.leaving and not self._closing:
            self.on_dead(member_id, lease, evidence, detail)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link()
        link.writer = writer
        link.task = asyncio.current_task()
        self._incoming.add(link)
        try:
            line = await asyncio.wait_for(reader.readline(), _HELLO_TIMEOUT_S)
            hello = json.loads(line)
            member_id, lease = str(hello["member_id"]), int(hello["lease"])
            await self._watch(reader, link, member_id, lease)
        except (asyncio.CancelledError, TimeoutError, ValueError, KeyError, OSError):
            pass  # not a ring peer, or it went before saying who it is: nothing to report
        finally:
            self._incoming.discard(link)
            with contextlib.suppress(Exception):
                writer.close()

    async def _follow(self, peer: RingPeer, link: _Link) -> None:
        host, _, port = peer.probe.rpartition(":")
        writer = None
        try:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host.strip("[]"), int(port)), _CONNECT_TIMEOUT_S)
            except ConnectionRefusedError as exc:
                if not link.leaving and not self._closing:
                    self.on_dead(peer.member_id, peer.lease, "refused", f"ring connect refused: {exc}")
                return
            except (TimeoutError, OSError) as exc:
                # Unreachable or slow is not dead: the TTL stays this peer's bound.
                self.log.info("membership.ring.unreachable", peer=peer.member_id, error=repr(exc)[:200])
                return
            link.writer = writer
            if link.leaving:
                return
            writer.write(self.hello)
            await writer.drain()
            await self._watch(reader, link, peer.member_id, peer.lease)
        except (asyncio.CancelledError, OSError):
            pass
        finally:
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()
