"""Start-up: the commands that only read a store (and ``import deltastore``) never import torch.

Each case runs in a fresh interpreter (the test process has torch imported already) and reports, after the
command, whether ``torch`` is in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

#: runs the CLI's main on argv, then prints on stderr's last line whether torch (and numpy) were imported
_PROBE = """
import json, sys
from deltastore.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules}), file=sys.stderr)
"""


def _probe(*argv: str, code: str = _PROBE) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DELTASTORE_NO_PROGRESS="1")
    done = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    from .conftest import make_states, publish_all

    uri = str(tmp_path_factory.mktemp("startup") / "s")
    publish_all(uri, make_states(6))
    return uri


READ_ONLY = [("--version",), ("--help",), ("ls", "--help"), ("ls", "{uri}"), ("ls", "{uri}", "--json"),
             ("inspect", "{uri}"), ("inspect", "{uri}", "2", "--json"), ("stats", "{uri}"),
             ("stats", "{uri}", "--json"), ("gc", "{uri}"), ("gc", "{uri}", "--json"), ("plugins",),
             ("plugins", "--json")]


@pytest.mark.parametrize("argv", READ_ONLY, ids=" ".join)
def test_read_only_commands_do_not_import_torch(argv, small_store):
    got = _probe(*(a.format(uri=small_store) for a in argv))
    assert got["rc"] == 0 and not got["torch"], got


def test_version_and_help_do_not_even_import_numpy():
    for argv in (("--version",), ("--help",), ("gc", "--help")):
        got = _probe(*argv)
        assert got["rc"] == 0 and not got["torch"] and not got["numpy"], (argv, got)


def test_gc_that_deletes_does_not_import_torch(small_store):
    # publishers that refresh reused objects before every commit (a refresh window of 0): a grace of 0 is allowed
    code = _PROBE.replace("from deltastore.cli import main",
                          "import deltastore.store\ndeltastore.store.REFRESH_WINDOW = 0.0\nfrom deltastore.cli import main")
    got = _probe("gc", small_store, "--keep-last", "1", "--keep-anchors", "1", "--grace", "0", code=code)
    assert got["rc"] == 0 and not got["torch"], got


def test_import_deltastore_is_cheap_until_a_tensor_class_is_touched():
    code = """
import json, sys
import deltastore as ds
cheap = {"torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules, "version": ds.__version__}
ds.Manifest, ds.open_store, ds.errors.DeltaStoreError  # reading stores: still no torch
reading = "torch" in sys.modules
publisher = ds.Publisher  # a tensor-handling class: torch now
print(json.dumps({**cheap, "reading": reading, "after": "torch" in sys.modules,
                  "same": publisher is sys.modules["deltastore.publish.publisher"].Publisher,
                  "unresolved": [n for n in ds.__all__ if not hasattr(ds, n)]}), file=sys.stderr)
"""
    got = _probe(code=code)
    assert not got["torch"] and not got["numpy"] and got["version"]
    assert not got["reading"] and got["after"] and got["same"] and got["unresolved"] == []


def test_lazy_names_resolve_to_the_defining_modules():
    import deltastore as ds
    import deltastore.codecs.base as base
    import deltastore.pull.subscriber as subscriber

    assert ds.Subscriber is subscriber.Subscriber and ds.Codec is base.Codec and ds.TensorSpec is base.TensorSpec
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ds.Nope  # noqa: B018


def test_a_spec_read_without_torch_resolves_its_dtype_when_asked():
    code = """
import json, sys
from deltastore.manifest import TensorRecord
rec = TensorRecord("w", "bfloat16", (2, 3), 6, "0" * 16)
before = "torch" in sys.modules
dtype = rec.spec.dtype
print(json.dumps({"before": before, "dtype": str(dtype), "numel": rec.spec.numel,
                  "nbytes": rec.spec.nbytes}), file=sys.stderr)
"""
    got = _probe(code=code)
    assert got == {"before": False, "dtype": "torch.bfloat16", "numel": 6, "nbytes": 12}


def test_dtype_tables_agree():
    from deltastore.tensor_spec import DTYPE_SIZES
    from deltastore.tensors import DTYPES

    assert DTYPE_SIZES.keys() == DTYPES.keys()
    assert all(DTYPES[name].itemsize == size for name, size in DTYPE_SIZES.items())


def test_ls_of_an_s3_store_does_not_import_torch(seaweed):
    from conftest import require_module
    from test_backends.conftest import make_bucket

    from .conftest import make_states, publish_all

    require_module("s3fs")
    bucket = make_bucket("s3-seaweedfs", seaweed)
    uri = f"s3://{bucket}/run"
    publish_all(uri, make_states(3), storage_options=seaweed.storage_options())
    opts = [x for k, v in seaweed.storage_options().items() for x in ("-o", f"{k}={json.dumps(v)}")]
    for command in ("ls", "stats", "inspect"):
        got = _probe(command, uri, *opts)
        assert got["rc"] == 0 and not got["torch"], (command, got)


def test_plugins_tells_a_missing_extra_without_importing_it(cli):
    from deltastore.registry import backends

    backends.register("cli-test-extra", "deltastore_no_such_module:Backend", install_hint="pip install extra-x")
    backends.register("cli-test-needs", "deltastore.backends.memory:MemoryBackend", requires=("no_such_dep_x",),
                      install_hint="pip install needs-x")
    try:
        rows = {r["name"]: r for r in json.loads(cli("plugins", "--json").out)["backends"]}
        loaded = {r["name"]: r for r in json.loads(cli("plugins", "--load", "--json").out)["backends"]}
    finally:
        backends.unregister("cli-test-extra")
        backends.unregister("cli-test-needs")
    assert "deltastore_no_such_module" not in sys.modules
    for name, module, hint in (("cli-test-extra", "deltastore_no_such_module", "pip install extra-x"),
                               ("cli-test-needs", "no_such_dep_x", "pip install needs-x")):
        assert not rows[name]["available"] and module in rows[name]["error"] and hint in rows[name]["error"]
        assert not loaded[name]["available"]
    assert rows["memory"]["available"] and loaded["memory"]["available"]
