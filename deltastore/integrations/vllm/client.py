"""Client helpers for an in-process ``vllm.LLM`` started with the worker extension."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ApplyError, ChecksumMismatchError
from ...signing import key_texts
from ._rpc import results as _results

log = logging.getLogger("deltastore.vllm")


def pull(llm: Any, uri: str, step: int | None = None, *, allow_anchor: bool = True, path: str | None = None,
         storage_options: dict[str, Any] | None = None, reset_prefix_cache: bool = True,
         trusted_keys: Any = None) -> dict[str, Any]:
    """Apply a version on every worker of ``llm`` (a ``vllm.LLM`` started with the extension).

    ``trusted_keys``: public keys (paths, PEM/OpenSSH text, key objects); only versions they signed are
    applied (sent to the workers as OpenSSH lines).

    Re-raises a worker's error with its deltastore type. After a successful
    apply the prefix cache is reset and the engine's weight version is set to
    ``"<step>"``. Returns worker 0's result.
    """
    res = _results(llm.collective_rpc("deltastore_pull", kwargs={
        "uri": uri, "step": step, "allow_anchor": allow_anchor, "path": path,
        "storage_options": storage_options or {}, "raise_errors": False, "trusted_keys": key_texts(trusted_keys)}))
    steps = {r["step"] for r in res}
    if len(steps) != 1:
        raise ApplyError(f"workers disagree on the applied version: {sorted(steps)}")
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    _set_weight_version(llm, str(res[0]["step"]))
    return res[0]


def _set_weight_version(llm: Any, label: str) -> None:
    eng = getattr(llm, "llm_engine", None)
    fn = getattr(eng, "set_weight_version", None)
    if fn is not None:
        try:
            fn(label)
        except Exception:  # older vLLM: no weight version
            log.debug("could not set the weight version", exc_info=True)


def version(llm: Any) -> dict[str, Any] | None:
    """Worker 0's ``deltastore_version()``."""
    return llm.collective_rpc("deltastore_version")[0]


def combine_verify(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the workers' ``deltastore_verify()`` reports into one verdict.

    A tensor is proven when one worker saw all of it, or when the workers'
    partial sums over distinct position sets (tensor-parallel shards;
    replicated shards counted once) add up to the whole tensor.
    """
    results = _results(results)
    steps = {r["step"] for r in results}
    if len(steps) != 1:
        return {"ok": False, "bad": [], "reason": f"workers serve different versions {sorted(steps)}"}
    names = list(results[0]["tensors"])
    bad, unproven = [], []
    for name in names:
        entries = [r["tensors"][name] for r in results]
        if any(e.get("ok") is False for e in entries):
            bad.append(name)
            continue
        if any(e.get("ok") is True for e in entries):
            continue
        served = [e for e in entries if e.get("source") == "served"]
        if not served:
            unproven.append(name)
            continue
        distinct: dict[str, tuple[int, int]] = {}
        for e in served:
            distinct[e["fingerprint"]] = (int(e["partial"], 16), int(e["count"]))
        total = sum(s for s, _ in distinct.values()) & ((1 << 64) - 1)
        count = sum(c for _, c in distinct.values())
        if count != entries[0]["numel"]:
            unproven.append(name)
        elif total != int(entries[0]["expected"], 16):
            bad.append(name)
    return {"ok": not bad and not unproven, "step": steps.pop(), "bad": bad, "unproven": unproven,
            "served": results[0].get("served", 0), "host": results[0].get("host", 0)}


def verify(llm: Any) -> dict[str, Any]:
    """Check the served weights of every worker against the manifest; raises
    :class:`ChecksumMismatchError` naming the differing tensors."""
    report = combine_verify(llm.collective_rpc("deltastore_verify", kwargs={"raise_errors": False}))
    if report["bad"]:
        raise ChecksumMismatchError(f"{len(report['bad'])} served tensor(s) differ from version "
                                    f"{report.get('step')}: {report['bad'][:5]}")
    if report["unproven"]:
        raise ChecksumMismatchError(f"{len(report['unproven'])} tensor(s) could not be checked: "
                                    f"{report['unproven'][:5]}")
    return report

