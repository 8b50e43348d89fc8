"""The etcd options every command that talks to etcd takes (endpoints, TLS, a user).

The password is never a command-line argument (it would show in ``ps`` and shell
history): it comes from ``ELASTIC_REFIT_ETCD_PASSWORD``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_refit.membership.client import EtcdConfig

__all__ = ["add_etcd_arguments", "etcd_config"]

PASSWORD_VARIABLE = "ELASTIC_REFIT_ETCD_PASSWORD"


def add_etcd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", required=True, help="etcd endpoint(s), HOST:PORT[,HOST:PORT...] "
                                                      "(https://HOST:PORT for TLS)")
    parser.add_argument("--etcd-ca-file", help="CA certificate that signed etcd's (turns TLS on)")
    parser.add_argument("--etcd-cert-file", help="client certificate, where etcd asks for one")
    parser.add_argument("--etcd-key-file", help="the client certificate's key")
    parser.add_argument("--etcd-user", help=f"etcd user (its password from ${PASSWORD_VARIABLE})")
    parser.add_argument("--etcd-allow-plaintext-password", action="store_true",
                        help="send the password even without TLS")


def etcd_config(args: argparse.Namespace) -> EtcdConfig:
    """The ``EtcdConfig`` the options describe; ``ValueError`` naming what is wrong."""
    from elastic_refit.membership.client import (
        EtcdConfig,  # grpc loads only for commands that use it
    )

    endpoints = tuple(e.strip() for e in args.etcd.split(",") if e.strip())
    if not endpoints:
        raise ValueError(f"--etcd needs HOST:PORT, got {args.etcd!r}")
    for flag, path in (("--etcd-ca-file", args.etcd_ca_file), ("--etcd-cert-file", args.etcd_cert_file),
                       ("--etcd-key-file", args.etcd_key_file)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path!r} is not a file")
    password = os.environ.get(PASSWORD_VARIABLE) if args.etcd_user else None
    if args.etcd_user and password is None:
        raise ValueError(f"--etcd-user {args.etcd_user!r} needs its password in ${PASSWORD_VARIABLE}")
    config = EtcdConfig(endpoints, username=args.etcd_user or None, password=password,
                        ca_cert=args.etcd_ca_file, client_cert=args.etcd_cert_file, client_key=args.etcd_key_file)
    if password is not None and not config.tls and not args.etcd_allow_plaintext_password:
        raise ValueError("the etcd password would travel in plain text: give --etcd-ca-file (TLS), an https:// "
                         "endpoint, or --etcd-allow-plaintext-password")
    return config
