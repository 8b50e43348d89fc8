"""RefitConfig grouped by concern (issue 33): the groups, the flat keywords and variables a
program written against the README uses, and how they combine."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_refit.runtime.config import FLAT, RefitConfig
from elastic_refit.runtime.settings import (
    EtcdAccess,
    PlanSettings,
    Timeouts,
    TransferSettings,
    VersionSettings,
)

IDENTITY = {"job": "job", "role": "inference", "member_id": "i0", "layout_rank": 1, "etcd": "127.0.0.1:2379"}


def test_flat_keywords_land_in_their_groups_and_read_back_flat():
    c = RefitConfig(**IDENTITY, ttl_s=3, epoch_deadline_s=12.0, bucket_bytes=1 << 20, relay=False,
                    staging_bytes=8 << 20, mode="staged", snapshot_bytes=5, etcd_allow_plaintext_password=True)
    assert c.timeouts == Timeouts(ttl_s=3, epoch_deadline_s=12.0)
    assert c.plan == PlanSettings(bucket_bytes=1 << 20, relay="off")
    assert c.transfer == TransferSettings(staging_bytes=8 << 20)
    assert c.versions == VersionSettings(mode="staged", snapshot_bytes=5)
    assert c.etcd_access == EtcdAccess(allow_plaintext_password=True)
    assert (c.ttl_s, c.bucket_bytes, c.relay, c.mode, c.etcd_allow_plaintext_password) == (3, 1 << 20, "off", "staged",
                                                                                            True)
    assert c.plan.options().bucket_bytes == 1 << 20
    assert c.timeouts.membership().ttl_s == 3
    assert c.transfer.executor_options().staging_bytes == 8 << 20
    assert c.transport_timeout_s == 4.0


def test_groups_given_whole_and_flat_keywords_on_top():
    c = RefitConfig(**IDENTITY, timeouts=Timeouts(ttl_s=4, epoch_deadline_s=20.0), ttl_s=5)
    assert c.timeouts == Timeouts(ttl_s=5, epoch_deadline_s=20.0)
    assert dataclasses.replace(c, ttl_s=6).timeouts == Timeouts(ttl_s=6, epoch_deadline_s=20.0)
    assert dataclasses.replace(c, member_id="i1").member_id == "i1"
    assert dataclasses.replace(c) == c


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"ttl": 3}, TypeError, r"unexpected keyword argument 'ttl' \(did you mean 'ttl_s'\?\)"),
    ({"timeouts": {"ttl_s": 3}}, ValueError, r"timeouts must be a Timeouts, got dict"),
    ({"plan": Timeouts()}, ValueError, r"plan must be a PlanSettings, got Timeouts"),
    ({"agent_stuck_s": 5.0}, ValueError, r"agent_stuck_s must be 0 \(off\) or seconds above epoch_deadline_s = 10.0, got 5.0"),
    ({"join_hold_s": -1.0}, ValueError, r"join_hold_s must be seconds in \[0, epoch_deadline_s = 10.0\], got -1.0"),
    ({"join_hold_s": 11.0}, ValueError, r"join_hold_s must be seconds in \[0, epoch_deadline_s = 10.0\], got 11.0"),
    ({"mode": "lazy"}, ValueError, r"mode must be one of in_place, staged, got 'lazy'"),
    ({"connect_ahead": "maybe"}, ValueError, r"connect_ahead must be one of auto, on, off, got 'maybe'"),
    ({"etcd_ca_file": "/nope.pem"}, ValueError, r"etcd_ca_file '/nope\.pem' is not a file"),
    ({"transfer": TransferSettings(staging_bytes=100), "bucket_bytes": 64}, ValueError,
     r"staging_bytes 100 must hold 4 buckets of 64 per concurrent round \(1\)"),
])
def test_bad_settings_are_one_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        RefitConfig(**IDENTITY, **kwargs)


def test_every_setting_is_a_variable_and_a_documented_field():
    names = RefitConfig.setting_names()
    assert len(names) == len(set(names))
    assert {"job", "role", "member_id", "layout_rank", "etcd", "ttl_s", "etcd_password", "bucket_bytes",
            "snapshot_bytes", "connect_ahead"} <= set(names)
    for flat, (group, name) in FLAT.items():
        assert name in {f.name for f in dataclasses.fields(type(getattr(RefitConfig(**IDENTITY), group)))}, flat
    assert "secret-pw" not in repr(RefitConfig(**IDENTITY, etcd_allow_plaintext_password=True, etcd_user="u",
                                               etcd_password="secret-pw"))


def test_from_env_reads_grouped_settings_by_their_flat_names():
    env = {"ELASTIC_REFIT_JOB": "j", "ELASTIC_REFIT_ROLE": "trainer", "ELASTIC_REFIT_MEMBER_ID": "t0",
           "ELASTIC_REFIT_LAYOUT_RANK": "0", "ELASTIC_REFIT_ETCD": "a:1,b:2", "ELASTIC_REFIT_TTL_S": "3",
           "ELASTIC_REFIT_VERIFY": "off", "ELASTIC_REFIT_RELAY": "on", "ELASTIC_REFIT_SNAPSHOT_BYTES": "1024"}
    c = RefitConfig.from_env(env, max_attempts=2)
    assert c.etcd == ("a:1", "b:2") and c.timeouts.ttl_s == 3 and c.transfer.verify is False
    assert c.plan.relay == "on" and c.versions == VersionSettings(snapshot_bytes=1024, max_attempts=2)
    with pytest.raises(ValueError, match=r"ELASTIC_REFIT_TTL_S='x' is not an integer"):
        RefitConfig.from_env({**env, "ELASTIC_REFIT_TTL_S": "x"})
    with pytest.raises(ValueError, match=r"ttl_s must be an int >= 2 .*\(from ELASTIC_REFIT_TTL_S='1'\)"):
        RefitConfig.from_env({**env, "ELASTIC_REFIT_TTL_S": "1"})


@given(ttl_s=st.integers(2, 60), bucket_kib=st.integers(1, 4096), rounds=st.integers(1, 4))
def test_flat_and_grouped_spellings_are_one_config(ttl_s, bucket_kib, rounds):
    bucket = bucket_kib << 10
    staging = 4 * bucket * rounds
    flat = RefitConfig(**IDENTITY, incarnation="x", host="h", ttl_s=ttl_s, epoch_deadline_s=ttl_s + 1.0,
                       bucket_bytes=bucket, concurrent_rounds=rounds, staging_bytes=staging)
    grouped = RefitConfig(**IDENTITY, incarnation="x", host="h",
                          timeouts=Timeouts(ttl_s=ttl_s, epoch_deadline_s=ttl_s + 1.0),
                          plan=PlanSettings(bucket_bytes=bucket, concurrent_rounds=rounds),
                          transfer=TransferSettings(staging_bytes=staging))
    assert flat == grouped and hash(flat) == hash(grouped)


def test_same_host_ipc_needs_a_cuda_device_and_lets_gloo_carry_the_rest():
    ipc = RefitConfig(**IDENTITY, device="cuda:0", backend="gloo", same_host="ipc")
    assert ipc.transfer.same_host == "ipc" and ipc.backend == "gloo"
    assert RefitConfig(**IDENTITY, device="cuda:1", backend="nccl4py", same_host="ipc").device == "cuda:1"
    with pytest.raises(ValueError, match=r"same_host 'ipc' maps peers' GPU memory: device must be a CUDA device"):
        RefitConfig(**IDENTITY, same_host="ipc")
    with pytest.raises(ValueError, match=r"backend 'gloo' moves cpu tensors, but device is 'cuda:0'"):
        RefitConfig(**IDENTITY, device="cuda:0", backend="gloo")  # no IPC: gloo stays on the CPU
    with pytest.raises(ValueError, match=r"same_host must be one of network, ipc, got 'shm'"):
        RefitConfig(**IDENTITY, same_host="shm")


@pytest.mark.parametrize(("same_host", "device"), [("network", None), ("ipc", "cuda:0")])
def test_the_communicators_route_same_host_pairs_over_ipc_only_when_asked(monkeypatch, same_host, device):
    from elastic_refit.runtime import rejoin

    made = {}
    monkeypatch.setattr(rejoin, "CommunicatorManager", lambda *args, **kw: made.update(kw) or kw)

    class _Membership:
        config, view = None, None

    config = RefitConfig(**IDENTITY, device="cuda:0", backend="nccl4py", same_host=same_host)
    rejoin.communicator_manager(object(), config, _Membership())
    assert made["direct_reads_device"] == device and made["device"] == "cuda:0"
