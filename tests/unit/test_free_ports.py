"""Free ports for test servers: distinct, bindable, and outside the kernel's ephemeral range
(where outgoing connections of tests running beside this one could take them first)."""

from __future__ import annotations

import socket

from elastic_refit.testing.etcd import _FIXED_LOW, _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(6)
    assert len(set(ports)) == 6
    low = _ephemeral_low()
    if low - _FIXED_LOW >= 24:
        assert all(_FIXED_LOW <= p < low for p in ports), (ports, low)
    socks = []
    try:
        for p in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()


def test_parallel_pickers_rarely_meet():
    # Two pickers (two test workers) drawing at random from ~12,000 ports.
    a, b = set(free_ports(4)), set(free_ports(4))
    assert len(a | b) >= 7
