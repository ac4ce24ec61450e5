"""``python -m deltastore.integrations.vllm follow ...``: the sidecar follower for a running ``vllm serve``."""

from __future__ import annotations

import argparse
import json
import logging

from ...signing import keys_from_env
from ._rpc import as_dict
from .follower import Follower, HTTPControl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltastore.integrations.vllm",
                                 description="deltastore tools for vLLM servers")
    sp = ap.add_subparsers(dest="cmd", required=True)
    f = sp.add_parser("follow", help="keep a running vllm serve on the newest version of a store")
    f.add_argument("--server", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    f.add_argument("--uri", required=True, help="the store")
    f.add_argument("--poll-interval", type=float, default=5.0)
    f.add_argument("--max-lag", type=int, default=0)
    f.add_argument("--max-wait", type=float, default=None)
    f.add_argument("--transport", choices=("rpc", "weight-transfer"), default="rpc")
    f.add_argument("--storage-options", default="{}", help="JSON object for the store backend")
    f.add_argument("--status-file", default=None)
    f.add_argument("--once", action="store_true", help="apply the newest version once and exit")
    f.add_argument("--trusted-key", dest="trusted_keys", action="append", default=None, metavar="KEY",
                   help="a public key file or OpenSSH line (repeatable; default: $DELTASTORE_TRUSTED_KEYS): apply "
                        "only versions it signed")
    f.add_argument("--max-latest-age", type=float, default=None, metavar="SECONDS",
                   help="with --trusted-key: refuse a signed latest older than this (a frozen store or relay)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    control = HTTPControl(args.server, transport=args.transport)
    fol = Follower(control, args.uri, poll_interval=args.poll_interval, max_lag=args.max_lag,
                   max_wait=args.max_wait, storage_options=as_dict(args.storage_options),
                   status_file=args.status_file, trusted_keys=args.trusted_keys or keys_from_env(),
                   max_latest_age=args.max_latest_age)
    if args.once:
        res = fol.poll_once()
        print(json.dumps(res if res is not None else fol.status()))
        return 0
    try:
        fol.run()
    except KeyboardInterrupt:
        pass
    return 0

