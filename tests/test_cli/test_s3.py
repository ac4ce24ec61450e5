"""The CLI on a real S3-compatible server (SeaweedFS) reached through ``-o`` / ``--storage-options``."""

from __future__ import annotations

import json
import uuid

from safetensors.torch import load_file

from conftest import require_module

from deltastore.testing import bits_equal
from test_backends.conftest import make_bucket

from .conftest import make_states, publish_all


def test_endpoint_url_through_o_and_storage_options(seaweed, tmp_path, cli):
    require_module("s3fs")
    bucket = make_bucket("s3-seaweedfs", seaweed)
    uri = f"s3://{bucket}/runs/r1"
    states = make_states(4)
    publish_all(uri, states, storage_options=seaweed.storage_options())
    creds = {"key": seaweed.storage_options()["key"], "secret": seaweed.storage_options()["secret"]}
    opts = ["-o", f"endpoint_url={seaweed.endpoint}", "--storage-options", json.dumps(creds)]

    doc = json.loads(cli("ls", uri, *opts, "--json").out)
    assert [v["step"] for v in doc["versions"]] == [0, 1, 2, 3]
    r = cli("verify", uri, *opts)
    assert r.rc == 0 and "4 versions, 4 replayed" in r.out
    assert cli("pull", uri, tmp_path / "ckpt", *opts).rc == 0
    assert bits_equal(load_file(tmp_path / "ckpt" / "model.safetensors"), states[3])
    # every option as -o, the JSON-parsed values too
    each = [f"endpoint_url={seaweed.endpoint}", f"key={creds['key']}", f"secret={creds['secret']}", "retry=2",
            "check_bucket=true"]
    assert cli("stats", uri, *[x for o in each for x in ("-o", o)]).rc == 0

    cli("ls", f"s3://{bucket}/runs/none", *opts).one_line_error(3, f"s3://{bucket}/runs/none", "not a deltastore")
    cli("ls", f"s3://missing-{uuid.uuid4().hex[:8]}/r", *opts).one_line_error(3, "does not exist")
    cli("ls", uri, "-o", f"endpoint_url={seaweed.endpoint}", "-o", "key=wrong", "-o", "secret=wrong",
        "-o", "retry=1").one_line_error(1, "deltastore: ")
