"""Store-layer bombs in a fresh interpreter, measured against its own memory peak (see memcheck.py).

    python -m test_reliability.storebomb URI OPTIONS_JSON WARM_URI     # from tests/

Pulls the latest version of ``WARM_URI`` first (so codecs and buffers are loaded) and opens ``URI``; then,
measured, pulls version 0 of ``URI`` and reads every manifest there. Prints one JSON line: the peak growth in MB
and the typed errors met.
"""

from __future__ import annotations

import json
import sys

from .memcheck import measure


def main(argv: list[str]) -> int:
    import torch

    import deltastore as ds
    from deltastore.errors import DeltaStoreError

    torch.set_num_threads(1)
    uri, options, warm = argv[0], json.loads(argv[1]), argv[2]
    ds.Subscriber(warm, storage_options=options).pull()
    sub = ds.Subscriber(uri, storage_options=options)  # opening a store (a client, its pools) is not measured

    def run() -> list[str]:
        errors = []
        for step in sub.versions():
            try:
                sub.store.manifest(step)
            except DeltaStoreError as e:
                errors.append(f"{type(e).__name__}: {e}")
        try:
            sub.pull(step=0)
        except DeltaStoreError as e:
            errors.append(f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - reported; the test fails on it
            errors.append(f"UNTYPED {type(e).__name__}: {e}")
        return errors

    growth, errors = measure(run)
    print(json.dumps({"growth_mb": round(growth, 1), "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
