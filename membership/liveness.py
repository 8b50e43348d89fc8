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
import bisect
import contextlib
import functools
import ipaddress
import json
import socket
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
    "ring_order",
    "ring_successor",
    "ring_successor_in",
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


@functools.lru_cache(maxsize=1 << 16)
def reachable_probe(probe: str, peer_host: str, my_host: str) -> bool:
    """Whether a peer's ``probe`` (``host:port``) can be reached from this member: a
    loopback address only from the same host (it would reach *our* host's loopback and be
    refused, which reads as a death). Cached: the ring asks about every member on every
    member change, and parsing the address was most of that work."""
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


def ring_order(peers: Iterable[RingPeer], my_host: str) -> tuple[tuple[str, ...], tuple[RingPeer, ...]]:
    """The ring of the members reachable from ``my_host``, sorted by key: (keys, peers).
    Built once per control snapshot and host and shared by the members of a process, each
    of which then finds its successor with :func:`ring_successor_in` in O(log members)."""
    ordered = tuple(sorted((p for p in peers if reachable_probe(p.probe, p.host, my_host)), key=lambda p: p.key))
    return tuple(p.key for p in ordered), ordered


def ring_successor_in(my_key: str, order: tuple[tuple[str, ...], tuple[RingPeer, ...]]) -> RingPeer | None:
    """:func:`ring_successor` of ``my_key`` in a :func:`ring_order` (the same answer)."""
    keys, peers = order
    i = bisect.bisect_right(keys, my_key)
    if i < len(peers):
        return peers[i]
    # Wrap around to the first key; if that is ours, we are alone (any other key would
    # sort after ours and have been found above).
    return peers[0] if peers and peers[0].key != my_key else None


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
        await _close_writer(writer)


DeathCallback = Callable[[str, int, str, str], None]  # (member_id, lease, evidence, detail)
_CLOSE_WAIT_S = 1.0  # aclose: how long to wait for our sockets to be closed by the loop


async def _close_writer(writer: asyncio.StreamWriter, timeout_s: float = _CLOSE_WAIT_S) -> bool:
    """Close ``writer`` and wait until its socket is closed (``close()`` alone only schedules
    that on the loop: a loop stopped before it runs leaves the socket open, in CLOSE_WAIT
    once the peer hangs up). Returns whether it closed within ``timeout_s``."""
    try:
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), timeout_s)
    except (TimeoutError, RuntimeError):
        return False
    except OSError:
        pass  # closed with an error (reset): closed all the same
    return True


class _Link:
    """One ring connection: its socket from the moment it exists, its writer once a
    stream wraps it (to say goodbye), and the task reading it."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None  # an accepted socket not wrapped yet
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task | None = None
        self.leaving = False  # we close it on purpose: its end is no evidence


class LivenessRing:
    """This member's end of the liveness ring: a listener that peers connect to, and one
    connection to its successor. ``on_dead(member_id, lease, evidence, detail)`` runs on
    the loop when a ring connection ends without a goodbye or a connect is refused.

    Every socket the ring opens or accepts is registered the moment it exists (before any
    task reads it), and :meth:`aclose` returns once all of them are closed. The listener
    is a plain socket that this class accepts on itself, synchronously, rather than an
    ``asyncio.Server``: on Python 3.11 a connection the server had accepted when it was
    closed fails to become a transport (``Server._attach`` asserts, silently outside debug
    mode) and its socket stays open with no owner until a garbage collection, in
    CLOSE_WAIT once the peer hangs up -- the leak the chaos matrix found on members that
    closed while a ring neighbour was reconnecting to them."""

    def __init__(self, host: str, member_id: str, lease: int, incarnation: str, on_dead: DeathCallback,
                 log) -> None:
        self.host = host
        self.hello = json.dumps({"member_id": member_id, "lease": lease, "incarnation": incarnation}).encode() + b"\n"
        self.on_dead = on_dead
        self.log = log
        self.address = ""
        self._listener: socket.socket | None = None
        self._links: set[_Link] = set()  # every open connection, incoming and outgoing
        self._successor: RingPeer | None = None
        self._out: _Link | None = None
        self._closing = False

    async def start(self) -> str:
        """Listen on a free port of ``host``; returns ``host:port`` (the record's probe)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.create_server((self.host.strip("[]"), 0), family=family, backlog=64)
        listener.setblocking(False)
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept_ready)
        self._listener = listener
        port = listener.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"{host}:{port}"
        return self.address

    def open_sockets(self) -> int:
        """How many sockets the ring holds now: connections (incoming and outgoing) whose
        close has not completed yet."""
        return sum(1 for link in self._links if link.writer is not None or link.sock is not None)

    def follow(self, peer: RingPeer | None) -> None:
        """Watch ``peer`` from now on (loop thread); a change says goodbye to the old one."""
        if self._closing or peer == self._successor:
            return
        old, self._out, self._successor = self._out, None, peer
        if old is not None:
            self._leave(old)
        if peer is not None:
            link = _Link()
            self._links.add(link)
            link.task = asyncio.ensure_future(self._follow(peer, link))
            self._out = link

    async def aclose(self) -> None:
        """Stop listening, say goodbye on every connection and close it; returns once every
        socket of the ring is closed (called after the lease is revoked, so that no
        goodbye-less end can be read as this member's death while it is still a member)."""
        self._closing = True
        if self._listener is not None:  # first: nothing new is accepted while we close the rest
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
        links = list(self._links)
        for link in links:
            self._leave(link)
        tasks = [link.task for link in links if link.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)
        for link in list(self._links):  # what the tasks did not close (or had not started)
            await self._forget(link)
        still_open = self.open_sockets()
        self.log.info("membership.ring.closed", links=len(links), still_open=still_open)

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

    async def _forget(self, link: _Link) -> None:
        """Close ``link``'s socket and drop it once it is closed."""
        if link.writer is not None:
            if not await _close_writer(link.writer):
                return  # still closing: counted by open_sockets
        elif link.sock is not None:
            link.sock.close()  # accepted, never wrapped in a stream (or the wrap failed)
        link.sock = None
        self._links.discard(link)

    def _accept_ready(self) -> None:
        """The listener is readable (loop thread): accept every pending connection, each
        registered as a link before anything can be cancelled or fail."""
        while self._listener is not None and not self._closing:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNABORTED, out of descriptors: the peer retries
                self.log.warning("membership.ring.accept_failed", error=repr(exc)[:200])
                return
            conn.setblocking(False)
            link = _Link()
            link.sock = conn
            self._links.add(link)
            link.task = asyncio.ensure_future(self._serve(link))

    async def _serve(self, link: _Link) -> None:
        try:
            reader, link.writer = await asyncio.open_connection(sock=link.sock)
            link.sock = None  # the stream owns it now
            line = await asyncio.wait_for(reader.readline(), _HELLO_TIMEOUT_S)
            hello = json.loads(line)
            member_id, lease = str(hello["member_id"]), int(hello["lease"])
            await self._watch(reader, link, member_id, lease)
        except (asyncio.CancelledError, TimeoutError, ValueError, KeyError, TypeError, OSError):
            pass  # not a ring peer, or it went before saying who it is: nothing to report
        finally:
            await self._forget(link)

    async def _follow(self, peer: RingPeer, link: _Link) -> None:
        host, _, port = peer.probe.rpartition(":")
        try:
            try:
                reader, link.writer = await asyncio.wait_for(
                    asyncio.open_connection(host.strip("[]"), int(port)), _CONNECT_TIMEOUT_S)
            except ConnectionRefusedError as exc:
                if not link.leaving and not self._closing:
                    self.on_dead(peer.member_id, peer.lease, "refused", f"ring connect refused: {exc}")
                return
            except (TimeoutError, OSError) as exc:
                # Unreachable or slow is not dead: the TTL stays this peer's bound.
                self.log.info("membership.ring.unreachable", peer=peer.member_id, error=repr(exc)[:200])
                return
            if link.leaving or self._closing:
                return
            link.writer.write(self.hello)
            await link.writer.drain()
            await self._watch(reader, link, peer.member_id, peer.lease)
        except (asyncio.CancelledError, OSError):
            pass
        finally:
            await self._forget(link)
