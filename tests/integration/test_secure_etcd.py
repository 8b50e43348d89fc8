"""A real etcd with TLS and authentication (certificates made at test time): the runtime
and ``status`` work with a job's credentials; another job's credentials can neither read
nor write its keys, so a forged ``committed`` key needs the job's own credentials (the
documented trust boundary: whoever holds them is trusted as the job)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from elastic_refit.membership import EtcdAccessDenied, EtcdClient, JobKeys
from elastic_refit.membership.client import EtcdConfig, Put

from elastic_refit.cli import main
from elastic_refit.layout import parse_spec
from elastic_refit.runtime import ElasticRefit, RefitConfig, RefitLayouts
from elastic_refit.testing.etcd import EtcdServer, enable_auth, make_certificates
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

pytestmark = pytest.mark.etcd

SPEC = parse_spec({"domains": [0, 1], "tensors": [
    {"name": "w", "shape": [16, 8], "dtype": "float32",
     "source": {"mesh": [0], "placements": ["R"]}, "destination": {"mesh": [1], "placements": ["R"]}}]})
LAYOUTS = RefitLayouts(SPEC.source, SPEC.destination)
USERS = {"alice": ("alice-pw", JobKeys("job-a").prefix), "bob": ("bob-pw", JobKeys("job-b").prefix)}
TOKEN_TTL_S = 2


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory):
    tls = make_certificates(str(tmp_path_factory.mktemp("pki")))
    # Tokens expire after TOKEN_TTL_S idle seconds (etcd's default is 300): clients must renew them.
    server = EtcdServer(name="secure", tls=tls, extra_args=["--auth-token-ttl", str(TOKEN_TTL_S)]).start()
    try:
        enable_auth(server.endpoint, tls.ca, "root-" + uuid.uuid4().hex, USERS)
        yield server, tls
    finally:
        server.stop()


def config(server, tls, role: str, member_id: str, rank: int, user: str = "alice", job: str = "job-a"):
    return RefitConfig(job=job, role=role, member_id=member_id, layout_rank=rank, etcd=(server.endpoint,),
                       domain=f"d{rank}", version_timeout_s=60.0, etcd_ca_file=tls.ca, etcd_user=user,
                       etcd_password=USERS[user][0])


def test_the_runtime_and_status_work_with_the_jobs_credentials(secure_etcd, capsys, monkeypatch):
    server, tls = secure_etcd
    report: dict = {}

    def trainer() -> None:
        try:
            with ElasticRefit(config(server, tls, "trainer", "t0", 0), LAYOUTS) as refit:
                for version in (1, 2):
                    tensors = allocate(SPEC.source, 0, fill=0)
                    fill_pieces(SPEC.source, 0, tensors, seed=version)
                    report.setdefault("committed", []).append(refit.publish(tensors, version).version)
        except BaseException as exc:  # reported, the test decides
            report["trainer_error"] = repr(exc)

    def inference() -> None:
        try:
            params = allocate(SPEC.destination, 1, fill=0)
            with ElasticRefit(config(server, tls, "inference", "i0", 1), LAYOUTS, parameters=params) as refit:
                refit.wait_for_version(2)
                with refit.weights() as serving:
                    report["problems"] = check_pieces(SPEC.destination, 1, params, seed=serving)
                    report["served"] = serving
        except BaseException as exc:
            report["inference_error"] = repr(exc)

    threads = [threading.Thread(target=f, daemon=True) for f in (trainer, inference)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), report
    assert "trainer_error" not in report and "inference_error" not in report, report
    assert report["committed"] == [1, 2] and report["served"] == 2 and report["problems"] == []

    capsys.readouterr()  # the members' own log lines
    monkeypatch.setenv("ELASTIC_REFIT_ETCD_PASSWORD", USERS["alice"][0])
    assert main(["status", "--etcd", server.endpoint, "--etcd-ca-file", tls.ca, "--etcd-user", "alice",
                 "--job", "job-a", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latest_committed"] == 2
    # Another job's user is refused, in one line naming etcd and the operation.
    monkeypatch.setenv("ELASTIC_REFIT_ETCD_PASSWORD", USERS["bob"][0])
    assert main(["status", "--etcd", server.endpoint, "--etcd-ca-file", tls.ca, "--etcd-user", "bob",
                 "--job", "job-a", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1] == (
        f"elastic-refit: error: etcd at {server.endpoint} refused range {JobKeys('job-a').prefix}: "
        "etcdserver: permission denied")


def test_another_jobs_credentials_cannot_read_write_or_forge_a_commit(secure_etcd):
    server, tls = secure_etcd
    committed = JobKeys("job-a").committed(7)
    forged = json.dumps({"version": 7, "epoch": 1, "digest": "0" * 32}).encode()
    with EtcdClient(EtcdConfig((server.endpoint,), username="bob", password=USERS["bob"][0], ca_cert=tls.ca)) as bob:
        bob.put(JobKeys("job-b").committed(7), forged)  # its own job: allowed
        with pytest.raises(EtcdAccessDenied, match="permission denied"):
            bob.put(committed, forged)
        with pytest.raises(EtcdAccessDenied, match="permission denied"):
            bob.get_prefix(JobKeys("job-a").prefix)
    anonymous = EtcdConfig((server.endpoint,), ca_cert=tls.ca)
    with EtcdClient(anonymous) as client, pytest.raises(EtcdAccessDenied, match="user name is empty"):
        client.put(committed, forged)
    guess = EtcdConfig((server.endpoint,), username="alice", password="wrong", ca_cert=tls.ca)
    with EtcdClient(guess) as client, pytest.raises(EtcdAccessDenied, match="authentication failed"):
        client.get(committed)
    with EtcdClient(EtcdConfig((server.endpoint,), username="alice", password=USERS["alice"][0],
                               ca_cert=tls.ca)) as alice:
        assert alice.get(committed) is None  # nothing forged reached job A


def test_an_expired_token_is_renewed_not_a_fatal_error(secure_etcd):
    """etcd drops a token after its TTL without a key-value request (lease keepalives do not
    count): a member idle for longer (a long RL step) must keep working, transactions too."""
    server, tls = secure_etcd
    key = JobKeys("job-a").prefix + "idle"
    with EtcdClient(EtcdConfig((server.endpoint,), username="alice", password=USERS["alice"][0],
                               ca_cert=tls.ca)) as alice:
        alice.put(key, b"1")
        time.sleep(TOKEN_TTL_S + 2)
        assert alice.get(key).value == b"1"
        time.sleep(TOKEN_TTL_S + 2)
        assert alice.txn([], [Put(key, b"2")]).succeeded
        assert alice.get(key).value == b"2"


def test_a_password_is_not_sent_without_tls_unless_allowed(secure_etcd):
    server, _ = secure_etcd
    plain = {"job": "job-a", "role": "trainer", "member_id": "t0", "layout_rank": 0, "etcd": (server.endpoint,),
             "etcd_user": "alice", "etcd_password": "alice-pw"}
    with pytest.raises(ValueError, match="an etcd password would travel in plain text"):
        RefitConfig(**plain)
    assert RefitConfig(**plain, etcd_allow_plaintext_password=True).etcd_config().password == "alice-pw"
    with pytest.raises(ValueError, match=r"etcd_ca_file '/nope\.pem' is not a file"):
        RefitConfig(**plain, etcd_ca_file="/nope.pem")
    assert "alice-pw" not in repr(RefitConfig(**plain, etcd_allow_plaintext_password=True))


def _cli_cases(server, tls, other_ca: str) -> list[tuple[str, list[str], str | None, int, str]]:
    """(case, status arguments, password, exit code, the one error line after 'elastic-refit:
    error: '; a line ending in '...' is a prefix: grpc words the rest of a TLS failure)."""
    op = f"range {JobKeys('job-a').prefix}"  # status first asks whether the job exists
    refused = f"etcd at {server.endpoint} refused {op}: etcdserver:"
    base = ["status", "--etcd", server.endpoint, "--job", "job-a", "--json"]
    return [
        ("another job's user", [*base, "--etcd-ca-file", tls.ca, "--etcd-user", "bob"], USERS["bob"][0], 1,
         f"{refused} permission denied"),
        ("a wrong password", [*base, "--etcd-ca-file", tls.ca, "--etcd-user", "alice"], "wrong", 1,
         f"{refused} authentication failed, invalid user ID or password"),
        ("no user", [*base, "--etcd-ca-file", tls.ca], None, 1, f"{refused} user name is empty"),
        ("a CA that did not sign etcd's certificate", [*base, "--etcd-ca-file", other_ca, "--etcd-user", "alice"],
         USERS["alice"][0], 1, f"etcd unreachable at {server.endpoint} during {op}: ConnectionFailedError: ..."),
        ("a password without TLS", [*base, "--etcd-user", "alice"], USERS["alice"][0], 2,
         "the etcd password would travel in plain text: give --etcd-ca-file (TLS), an https:// endpoint, or "
         "--etcd-allow-plaintext-password"),
    ]


def test_tls_and_auth_errors_of_the_cli_are_one_line(secure_etcd, capsys, monkeypatch, tmp_path):
    server, tls = secure_etcd
    other_ca = make_certificates(str(tmp_path / "other")).ca
    for name, argv, password, code, message in _cli_cases(server, tls, other_ca):
        if password is None:
            monkeypatch.delenv("ELASTIC_REFIT_ETCD_PASSWORD", raising=False)
        else:
            monkeypatch.setenv("ELASTIC_REFIT_ETCD_PASSWORD", password)
        capsys.readouterr()
        start = time.monotonic()
        assert main(argv) == code, name
        out, err = capsys.readouterr()
        assert out == "", name
        errors = [line for line in err.splitlines() if line.startswith("elastic-refit: error: ")]
        assert len(errors) == 1, (name, err[-2000:])
        if message.endswith("..."):
            assert errors[0].startswith(f"elastic-refit: error: {message[:-3]}"), (name, errors)
            assert "CERTIFICATE_VERIFY_FAILED" in errors[0], (name, errors)
        else:
            assert errors == [f"elastic-refit: error: {message}"], (name, errors)
        assert "Traceback" not in err, name
        assert time.monotonic() - start < 30, (name, time.monotonic() - start)
