"""Bad input to the CLI commands other than ``plan`` (whose table is in test_cli_plan.py):
each is one ``elastic-refit: error:`` line on stderr, exit 2, nothing on stdout, and nothing
started (every case fails before a process, a world or an etcd exists)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest

from elastic_refit import cli

MODEL = ["--model", "llama-3.1-8b", "--source", "tp=2", "--destination", "tp=2", "--layers", "1"]

CASES = [
    (["demo", "--versions", "0"], "num_versions must be >= 2, got 0"),
    (["demo", "--inference", "3"], "num_inference must be an even number >= 4 (TP=2 replicas; one rank is killed "
                                   "and catches up from its replica), got 3"),
    (["chaos", "--trials", "0"], "trials must be >= 1, got 0"),
    (["chaos", "--inference", "1"], "--inference must be >= 2 (a replica makes recovery possible), got 1"),
    (["chaos", "--minutes", "5"], "--minutes is for --matrix none and must be > 0, got 5.0 with quick"),
    (["chaos", "--matrix", "none", "--minutes", "0"], "--minutes is for --matrix none and must be > 0, got 0.0 with none"),
    (["chaos", "--matrix", "none", "--burn", "-1"], "--burn must be >= 0, got -1"),
    (["chaos", "--matrix", "none", "--faults", "kill"], "the 'none' matrix has no fault cells to keep, got faults=['kill']"),
    (["bench", *MODEL, "--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["bench", *MODEL, "--timeout", "nan"], "--warmup must be >= 0, --chunk-mib and --timeout > 0; got 1, 8.0, nan"),
    (["bench", *MODEL, "--chunk-mib", "inf"], "--warmup must be >= 0, --chunk-mib and --timeout > 0; got 1, inf, auto"),
    (["bench", *MODEL, "--domain-size", "0"], "--domain-size must be >= 1, got 0"),
    (["bench", "soak", "--versions", "5"], "--versions must be >= 20 (two windows of 10 at least), got 5"),
    (["bench", "soak", "--block", "0"], "--block must be >= 1, got 0"),
    (["bench", "soak", "--etcd-compaction", "hourly"],
     "--etcd-compaction must be revision:N or periodic:DURATION (etcd's units, e.g. 10s), got 'hourly'"),
    (["status", "--etcd", "nohostport", "--job", "j"], "endpoint must look like host:port, got 'nohostport'"),
    (["status", "--etcd", "127.0.0.1:1", "--job", "j", "--last", "0"], "--last must be >= 1, got 0"),
    (["status", "--etcd", "127.0.0.1:1", "--job", "j", "--etcd-ca-file", "/nope.pem"],
     "--etcd-ca-file '/nope.pem' is not a file"),
    (["status", "--etcd", "127.0.0.1:1", "--job", "j", "--etcd-user", "u"],
     "--etcd-user 'u' needs its password in $ELASTIC_REFIT_ETCD_PASSWORD"),
    (["status", "--etcd", "127.0.0.1:1", "--job", "j", "--etcd-user", "u", "password:pw"],
     "the etcd password would travel in plain text: give --etcd-ca-file (TLS), an https:// endpoint, or "
     "--etcd-allow-plaintext-password"),
    (["status", "--etcd", "127.0.0.1:1"], "status: the following arguments are required: --job (see --help)"),
    (["worker", "--model", "llama-3.1-8b", "--parallelism", "tp=2", "--versions", "0"],
     "--versions must be >= 1, got 0"),
    (["worker", "--model", "llama-3.1-8b", "--parallelism", "tp=2"],
     "missing configuration: ELASTIC_REFIT_JOB, ELASTIC_REFIT_ROLE, ELASTIC_REFIT_MEMBER_ID, "
     "ELASTIC_REFIT_LAYOUT_RANK, ELASTIC_REFIT_ETCD"),
    (["worker", "--model", "llama-3.1-8b"], "give --model and --parallelism (a preset of this side), or --layout FILE"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, argv, message):
    for variable in [v for v in os.environ if v.startswith("ELASTIC_REFIT_")]:
        monkeypatch.delenv(variable)
    if argv[-1].startswith("password:"):  # the password comes from the environment, never argv
        monkeypatch.setenv("ELASTIC_REFIT_ETCD_PASSWORD", argv[-1].removeprefix("password:"))
        argv = argv[:-1]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.strip().splitlines() == [f"elastic-refit: error: {message}"]


def test_sigterm_unwinds_the_command_so_it_stops_what_it_started(capsys, monkeypatch):
    cleaned: list[str] = []

    def handler(_args) -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
            return 0
        finally:
            cleaned.append("etcd and members stopped")

    parser = cli.build_parser()
    monkeypatch.setattr(parser, "parse_args", lambda _argv: argparse.Namespace(handler=handler, debug=False))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    before = signal.getsignal(signal.SIGTERM)
    code = cli.main(["bench", "soak"])
    assert code == 128 + signal.SIGTERM and cleaned == ["etcd and members stopped"]
    assert capsys.readouterr().err.strip() == "elastic-refit: terminated"
    assert signal.getsignal(signal.SIGTERM) is before  # a program that calls main() keeps its own
