"""Timing knobs of membership and the order they must keep.

collective timeout < lease TTL < epoch deadline: a collective stuck on a dead peer fails
before the peer's lease expires (so the runtime is already waiting for the next epoch
when it comes), and the epoch deadline leaves room for a lease to expire, the leader to
publish, and the communicator to be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_refit.membership.keys import check_name


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Timeouts, pacing and run of one member; defaults suit a 2 s TTL on loopback."""

    ttl_s: int = 2
    keepalive_interval_s: float | None = None  # default ttl/3: two misses still keep the lease
    debounce_s: float = 0.03
    max_debounce_s: float = 0.25
    collective_timeout_s: float = 1.5
    epoch_deadline_s: float = 10.0
    abort_timeout_s: float = 1.0
    progress_interval_s: float = 1.0
    stall_timeout_s: float = 3.0
    candidate: bool = True
    # Suspicion (SWIM-style, with refutation): a live suspect deletes the suspicion on its
    # own key within this window, from its membership loop (not the agent thread, which may
    # be busy); unrefuted, the suspect is fenced. Far below the TTL, above a loop's reaction
    # time on a loaded host (a watch event plus one transaction: milliseconds). Short because
    # a reporter checks its evidence first (the suspect's listener refuses or drops a new
    # connection): a live member is practically never suspected, so the window is a net.
    refute_window_s: float = 0.1
    # The liveness ring: every member listens on this host and holds one TCP connection to
    # its successor in member-key order (and so one from its predecessor). A connection that
    # ends without a goodbye (EOF, reset) or a refused connect is evidence that the process
    # is dead. Multi-host jobs set the address peers reach this member at; a loopback host
    # is only used by peers on the same ``host``. None: no ring (TTL expiry, and suspicions
    # from transport failures, remain).
    liveness_host: str | None = "127.0.0.1"
    # An inference newcomer waits at most this long outside the epoch while the version that
    # was pending when it registered is on its way (membership.admission): a recovery's
    # commit does not wait for a grow. 0: newcomers join the next epoch at once.
    join_hold_s: float = 2.0
    # The run this member belongs to (``RefitConfig.run_id``): a job name held by another run
    # id is refused at start (``RunClash``). None: the member joins whatever run is there.
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.run_id is not None:
            check_name("run_id", self.run_id)
        if not 0 <= self.join_hold_s <= self.epoch_deadline_s:
            raise ValueError(f"join_hold_s must be in [0, epoch_deadline_s = {self.epoch_deadline_s}], "
                             f"got {self.join_hold_s}")
        if not isinstance(self.ttl_s, int) or self.ttl_s < 2:
            raise ValueError(f"ttl_s must be an int >= 2 (etcd grants no less), got {self.ttl_s!r}")
        ka = self.keepalive_interval
        if not 0 < ka < self.ttl_s / 2:
            raise ValueError(
                f"keepalive_interval_s must be in (0, ttl_s/2) = (0, {self.ttl_s / 2}), got {ka}"
            )
        if not 0 <= self.debounce_s <= self.max_debounce_s:
            raise ValueError(
                f"need 0 <= debounce_s <= max_debounce_s, got {self.debounce_s} and "
                f"{self.max_debounce_s}"
            )
        if not 0 < self.collective_timeout_s < self.ttl_s < self.epoch_deadline_s:
            raise ValueError(
                "timeouts must be ordered collective < lease TTL < epoch deadline, got "
                f"collective_timeout_s={self.collective_timeout_s}, ttl_s={self.ttl_s}, "
                f"epoch_deadline_s={self.epoch_deadline_s}"
            )
        if not 0 < self.abort_timeout_s <= self.epoch_deadline_s:
            raise ValueError(
                f"abort_timeout_s must be in (0, epoch_deadline_s={self.epoch_deadline_s}], "
                f"got {self.abort_timeout_s}"
            )
        if not 0 < self.refute_window_s < self.ttl_s / 2:
            raise ValueError(
                f"refute_window_s must be in (0, ttl_s/2) = (0, {self.ttl_s / 2}): a crash must be "
                f"confirmed well before its lease would expire, got {self.refute_window_s}"
            )
        if self.liveness_host is not None and not (isinstance(self.liveness_host, str) and self.liveness_host):
            raise ValueError(f"liveness_host must be a non-empty host or None, got {self.liveness_host!r}")
        if not 0 < self.progress_interval_s < self.stall_timeout_s:
            raise ValueError(
                f"need 0 < progress_interval_s < stall_timeout_s, got {self.progress_interval_s}"
                f" and {self.stall_timeout_s}"
            )

    @property
    def keepalive_interval(self) -> float:
        return self.keepalive_interval_s if self.keepalive_interval_s is not None else self.ttl_s / 3
