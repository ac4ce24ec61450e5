"""Named mutants: each breaks one promise of the library in a temporary copy; the suite must fail for each.

    .venv/bin/python tests/mutants.py                 # every mutant, on a copy of the working tree
    .venv/bin/python tests/mutants.py no-rollback     # some of them
    .venv/bin/python tests/mutants.py --rev HEAD      # on a committed revision (git archive)
    make mutants

The working tree is never touched: the repository (its tracked and untracked,
not ignored files, or ``--rev``'s tree) is copied to a temporary directory and
its compiled kernels are built there (again after each mutant of a kernel
source: ``deltastore/kernels/_*.pyx``, ``_simd.h``), each mutant is applied
there (a literal edit that must match exactly once, so a mutant that no
longer applies is an error, not a pass), the tests that guard
that promise run there with this interpreter and ``PYTHONPATH`` pointing at
the copy (checked: ``deltastore.__file__`` must lie in the copy, not in the
editable install), and the edit is undone. First the same tests run on the
unmutated copy: they must pass, so every failure afterwards is the mutant's.

A mutant is *caught* when at least one of its tests fails, or pytest is killed
by a signal (a crash fails the suite too); the script prints which ones and
exits 1 if any mutant survives. Not part of CI (``make test``):
about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("DELTASTORE_TRACES", ROOT.parent / "shared" / "traces")).resolve()


@dataclass
class Mutant:
    name: str
    what: str
    edits: list[tuple[str, str, str]]  # (file, text, replacement): text must occur exactly once
    tests: list[str]                    # test files or node ids that guard the promise
    caught_by: list[str] = field(default_factory=list)


REL = "tests/test_reliability/test_reliability.py::"
FALSE = "tests/test_reliability/test_false_claims.py::"
MUTANTS = [
    Mutant("sha256-on-read", "objects are not checked against their sha256 digest when read (nor when prefetched)",
           [("deltastore/store.py", "if sha256_digest(data) != digest:", "if False:"),
            ("deltastore/store.py", "len(data) == size and sha256_digest(data) == d", "len(data) == size")],
           ["tests/test_bad_inputs.py", REL + "test_corruption_is_detected_never_applied"]),
    Mutant("checksum-before-apply", "tensor checksums are not checked before a decoded version is applied",
           [("deltastore/pull/staging.py", "    if actual != int(rec.checksum, 16):\n", "    if False:\n")],
           ["tests/test_bad_inputs.py", "tests/test_vllm/test_mapping.py"]),
    Mutant("raw-decode-error", "the manifest parser lets a raw JSONDecodeError/UnicodeDecodeError escape",
           [("deltastore/manifest.py", "except (ValueError, UnicodeDecodeError, RecursionError) as e:",
             "except RecursionError as e:")],
           ["tests/test_core_units.py", "tests/test_bad_inputs.py", REL + "test_hostile_input_typed_errors_only"]),
    Mutant("no-rollback", "a failed write into the target is not undone (ApplyError still says restored)",
           [("deltastore/pull/transaction.py", "        for step in reversed(undo):\n", "        for step in []:\n")],
           ["tests/test_bad_inputs.py", REL + "test_apply_interrupted_restores_the_target"]),
    Mutant("no-zstd-bound", "zstd frames are decompressed without checking their declared size first",
           [("deltastore/codecs/_common.py", "if params.content_size != expected:", "if False:")],
           [REL + "test_zstd_bombs_are_refused_without_inflating", REL + "test_hostile_input_typed_errors_only"]),
    Mutant("no-zstd-bound-at-all", "zstd frames (every built-in codec, dense 2.1's planes too) are decompressed "
           "without the declared-size check and without an output bound",
           [("deltastore/codecs/_common.py", "if params.content_size != expected:", "if False:"),
            ("deltastore/codecs/_common.py", "max_output_size=expected", "max_output_size=0")],
           [REL + "test_zstd_bombs_are_refused_without_inflating"]),
    Mutant("batch-name-order", "ulp encodes a flat update batch in the order it was given, not in name order",
           [("deltastore/codecs/ulp.py", "            batch = batch.subset(sorted(range(n), key=names.__getitem__))\n",
             "            pass\n")],
           ["tests/test_update_batch.py"]),
    Mutant("take-one-part", "a tensor straddling two parts of the compare's output is cut at the first one",
           [("deltastore/kernels/_diff.pyx", "            a = e\n            k += 1\n", "            a = b\n")],
           ["tests/test_update_batch.py"]),
    Mutant("publish-per-tensor", "the synchronous publish hands every tensor to the codec as its own Update",
           [("deltastore/publish/objects.py", "                if diff is not None:  # in name order",
             "                if False:  # in name order")],
           ["tests/test_update_batch.py"]),
    Mutant("pull-batch-unchecked",
           "a delta's decoded batches are staged without checking counts, bounds, dtypes or positions",
           [("deltastore/pull/objects.py", "        _check_batch(b, held, wholes, role, manifest.step)\n", "")],
           ["tests/test_decode_batch.py"]),
    Mutant("in-place-unchecked", "changes a decoder wrote into the target in place are not checked against the "
           "manifest's checksums",
           [("deltastore/pull/staging.py", """        written_sums = [_expect_sums(manifest, names, self.checksums, b.target.sums, "applying the delta to the target")
                        for names, b in written]""",
             """        written_sums = [[int(manifest.checksum_values[n]) for n in names] for names, b in written]""")],
           ["tests/test_bad_inputs.py"]),
    Mutant("row-counts-unchecked", "the counts of a batch a decoder wrote in place are not compared with the "
           "manifest's on the row path (a follower one delta behind)",
           [("deltastore/pull/objects.py",
             "        _check_counts_of(b.bounds, expected, lambda i: manifest.tensors[int(rows[i])].name, manifest.step)\n",
             "")],
           ["tests/test_decode_batch.py"]),
    Mutant("earlier-deltas-not-undone", "a pull several deltas behind that fails in its last delta puts back only "
           "that one, not the deltas it wrote before it",
           [("deltastore/pull/transaction.py", "        for restore in reversed(self._entries):\n",
             "        for restore in reversed(self._entries[-2:]):\n")],
           ["tests/test_bad_inputs.py", "tests/test_batched_reads.py"]),
    Mutant("in-place-not-undone", "a failed pull leaves what decoders wrote in place in the target",
           [("deltastore/pull/staging.py", "                    target.undo()\n", "                    pass\n")],
           ["tests/test_bad_inputs.py"]),
    Mutant("in-place-segment-not-stepped-back", "a tensor the in-place kernel meets a bad item in keeps the items "
           "written before it",
           [("deltastore/kernels/_bitstream.pyx",
             "                a[r] = <step_t>_unapplied(_plane_step(planes, seg_e + d), <int64_t>a[r], fmag)\n",
             "                pass\n")],
           ["tests/test_kernels.py", "tests/test_bad_inputs.py"]),
    Mutant("anchor-placed-unjournaled",
           "an anchor object decoded straight into the target overwrites it without saving its old bits",
           [("deltastore/pull/anchor.py", "                journal.save_many(flats)\n", "                pass\n"),
            ("deltastore/pull/undo.py", "                self._journal.save_many(group)\n", "                pass\n")],
           ["tests/test_anchor_placed.py"]),
    Mutant("anchor-placed-unverified",
           "tensors decoded straight into the target are not checked against the manifest's checksums",
           [("deltastore/pull/anchor.py", "                if verify:\n                    _verify(am, complete, "
             "flats)\n", "")],
           ["tests/test_anchor_placed.py"]),
    Mutant("anchor-torch-path-unverified",
           "an anchor's tensors written through torch ops (subclasses, accelerators) skip the checksum",
           [("deltastore/pull/anchor.py", "        if full_checksum(names[i], tensors[i]) != want[names[i]]:",
             "        if False:")],
           ["tests/test_anchor_placed.py", "tests/test_bad_inputs.py", "tests/test_scale_paths.py"]),
    Mutant("journal-file-offsets", "the undo journal records each tensor written to its file at its end, not its start",
           [("deltastore/pull/undo.py", "offsets = ((ends[n_mem:] - sizes[n_mem:] - base)", "offsets = ((ends[n_mem:] - base)")],
           ["tests/test_anchor_placed.py"]),
    Mutant("journal-restores-as-given", "the undo journal puts old bits back into a target tensor as it was given "
           "(shaped, a float dtype) instead of into its flat bit view",
           [("deltastore/pull/undo.py", "                    flat = bits_view(flat)  # a tensor saved", "                    # a tensor saved")],
           ["tests/test_anchor_placed.py"]),
    Mutant("parent-vouches-unread", "a commit trusts its parent's objects without reading the parent's manifest "
           "again (a manifest gone or rewritten since still waives the wait for GC deletes)",
           [("deltastore/store.py", "            if sha256_digest(data) != parent.digest:\n                return frozenset()\n",
             "")],
           ["tests/test_reliability/test_commit_parent.py"]),
    Mutant("journal-short-read", "the undo journal takes one short read of its file for the whole tensor",
           [("deltastore/pull/undo.py", "        while got < into.nbytes:\n", "        if got < into.nbytes:\n")],
           ["tests/test_anchor_placed.py"]),
    Mutant("journal-short-write", "the undo journal writes a buffer the kernel cut short again from its start",
           [("deltastore/pull/undo.py", "                chunk[k, 0] += np.uint64(done)\n", "")],
           ["tests/test_anchor_placed.py"]),
    Mutant("dense-into-unchecked", "dense decode_into writes into destinations of another size",
           [("deltastore/codecs/dense.py", "and list(map(torch.Tensor.numel, dests)) == list(map(_NUMEL, specs)))",
             "and True)")],
           ["tests/test_anchor_placed.py"]),
    Mutant("pending-lazy-slice", "a staged batch's per-tensor entry is cut one element too long",
           [("deltastore/pull/staging.py", "        lo, hi = int(bounds[i]), int(bounds[i + 1])\n",
             "        lo, hi = int(bounds[i]), int(bounds[i + 1]) + 1\n")],
           ["tests/test_decode_batch.py"]),
    Mutant("manifest-newline-name",
           "the manifest's column pass takes a tensor name with a newline inside as two lines",
           [("deltastore/manifest.py", 'joined.count("\\n") != n or ', "")],
           ["tests/test_manifest_parse.py"]),
    Mutant("manifest-roles-unchecked",
           "the manifest's one-pass role rules see no problem where the record loop finds one",
           [("deltastore/manifest.py",
             "    if not has_differential and any(t.diff or t.diff_changed for t in tensors):\n        return False\n",
             "")],
           ["tests/test_manifest_parse.py"]),
    Mutant("full-state-batch-unchecked", "host-side staging writes a decoded batch without checking its checksums",
           [("deltastore/pull/staging.py", """                sums = _checked_sums(manifest, names, self.checksums, b.positions, old, b.bits, b.bounds,
                                     "applying the delta")""",
             """                sums = [int(manifest.checksum_values[n]) for n in names]""")],
           ["tests/test_batched_reads.py"]),
    Mutant("full-state-per-tensor", "host-side staging applies a decoded batch tensor by tensor",
           [("deltastore/pull/staging.py", "                if not names or old is None:\n                    loose.update",
             "                if True:\n                    loose.update")],
           ["tests/test_batched_reads.py"]),
    Mutant("merged-batch-stale-bits", "a batch merged with staged changes keeps the earlier delta's bits",
           [("deltastore/kernels/_merge.pyx", "            ubits[k] = sb if a < c else nb\n",
             "            ubits[k] = sb if a <= c else nb\n")],
           ["tests/test_batched_reads.py"]),
    Mutant("merged-batch-original", "a merged batch keeps the staged bits as the target's originals",
           [("deltastore/kernels/_merge.pyx", "            uorig[k] = bf if c < a else so\n",
             "            uorig[k] = bf if c < a else (so if c == a else sb)\n")],
           ["tests/test_batched_reads.py"]),
    Mutant("staged-overlay-no-fallback", "old bits read out of order over staged deltas skip the staged bits",
           [("deltastore/pull/staging.py", "        if segments.overlay_staged((spos, sbits, sbounds), positions, bounds, old):\n"
                                    "            return old\n",
             "        segments.overlay_staged((spos, sbits, sbounds), positions, bounds, old)\n            return old\n")],
           ["tests/test_batched_reads.py"]),
    Mutant("layout-holds-no-shape", "the one-pass target layout check ignores shapes",
           [("deltastore/pull/checks.py", "list(map(_DTYPE, ts)) == dtypes and list(map(_SHAPE, ts)) == shapes",
             "list(map(_DTYPE, ts)) == dtypes")],
           ["tests/test_bad_inputs.py"]),
    Mutant("layout-holds-no-contiguity", "the one-pass target layout check ignores contiguity",
           [("deltastore/pull/checks.py", "\n                and all(map(torch.Tensor.is_contiguous, ts)))", ")")],
           ["tests/test_bad_inputs.py"]),
    Mutant("tensor-columns-any-length", "tensor columns of unequal lengths are zipped (the shortest wins)",
           [("deltastore/manifest.py", "        if len(c) != len(columns[0]):", "        if False:")],
           ["tests/test_manifest_parse.py"]),
    Mutant("tensor-columns-any-version", "columns are read under any format version",
           [("deltastore/manifest.py", "    if columnar(version):  # checked as columns",
             "    if isinstance(doc.get(\"tensors\"), dict):  # checked as columns")],
           ["tests/test_manifest_parse.py"]),
    Mutant("staged-flat-stale", "the staged changes gathered for a batch are kept after a later delta is staged",
           [("deltastore/pull/staging.py", "        names = batch[0]\n        self._flats.clear()\n", "        names = batch[0]\n")],
           ["tests/test_batched_reads.py"]),
    Mutant("staged-flat-twice", "a batch touched again gathers its staged changes for its decoder and again to merge",
           [("deltastore/pull/staging.py", "        if key not in self._flats:\n", "        if True:\n")],
           ["tests/test_batched_reads.py"]),
    Mutant("manifest-cache-unheld", "a hold does not keep the manifests of a pull's path (each read again)",
           [("deltastore/manifest_cache.py", "            if not self._holders:\n                self._trim()\n\n    def pop",
             "            self._trim()\n\n    def pop")],
           ["tests/test_manifest_cache.py"]),
    Mutant("manifest-cache-unbounded", "the manifest cache keeps every manifest it ever read",
           [("deltastore/manifest_cache.py", "        while len(items) > self.keep and", "        while False and")],
           ["tests/test_manifest_cache.py"]),
    Mutant("differential-rows-order", "a differential's rows selected out of order come back in table order",
           [("deltastore/publish/drift.py", "                                                  t.bounds, idx)",
             "                                                  t.bounds, np.sort(idx))")],
           ["tests/test_update_batch.py"]),
    Mutant("frames-any-dtype", "a sparse codec's frame of another dtype is read as bytes",
           [("deltastore/codecs/_common.py", "        if dtype != \"U8\" or len(shape) != 1:", "        if False:")],
           ["tests/test_codecs/test_bad_input.py"]),
    Mutant("ulp-ordered-unsigned", "the ulp steps of floats are taken on raw bits, not the ordered image",
           [("deltastore/kernels/_bitstream.pyx", "    return x ^ ((x >> 63) & fmag)", "    return x"),
            ("deltastore/kernels/_simd.h", "    return x ^ ((x >> 63) & fmag);", "    return x;")],
           ["tests/test_kernels.py"]),
    Mutant("fresh-dict-untracked", "the dict a pull returns is not tracked (its next pull takes an anchor)",
           [("deltastore/pull/transaction.py", "            self._track(out.ref, out.state)  # tracked weakly",
             "            pass  # tracked weakly")],
           ["tests/test_follower_loop.py"]),
    Mutant("pending-kept-after-write", "a background publisher keeps a written version's changes until the next publish",
           [("deltastore/publish/publisher.py", "        self._pending.prune(captured.step)", "        pass")],
           ["tests/test_background.py"]),
    Mutant("writer-holds-last-version", "the background writer holds the last version it wrote while it waits",
           [("deltastore/publish/background.py", "                entry = item = future = None", "                pass")],
           ["tests/test_background.py"]),
    Mutant("drift-merge-keeps-returned", "an element that changes back to the anchor's bits stays in the drift "
           "(the committed merge)",
           [("deltastore/kernels/_diff.pyx", "        keep = (a != x) | (anc != cn[j])\n        pos[w - 1]",
             "        keep = 1\n        pos[w - 1]")],
           ["tests/test_drift.py"]),
    Mutant("drift-count-keeps-returned", "an element that changes back to the anchor's bits is still counted as drift",
           [("deltastore/kernels/_diff.pyx", "        keep = (a != x) | (anc != cn[j])\n        if write:",
             "        keep = 1\n        if write:")],
           ["tests/test_drift.py"]),
    Mutant("drift-runs-overlap", "runs of rows merged on several threads start their output at the wrong place",
           [("deltastore/publish/drift.py", "self._each(out_pos, out_anchor, out_bounds, starts[:-1], write=True)",
             "self._each(out_pos, out_anchor, out_bounds, [0] * len(self.runs), write=True)")],
           ["tests/test_drift.py"]),
    Mutant("drift-budget-ignored", "the drift tracker keeps every drifted position whatever its budget",
           [("deltastore/publish/drift.py", "            if budget_bytes is None or held <= budget_bytes or rate >= _MAX_RATE_LOG2:",
             "            if True:")],
           ["tests/test_drift.py", "tests/test_anchors_gc.py"]),
    Mutant("anchor-copy-unverified", "a differential compares with the local anchor copy without checking its "
           "tensors against the anchor's checksums",
           [("deltastore/publish/anchor_copy.py", "            if s != self._checksums[n]:", "            if False:")],
           ["tests/test_anchor_copy.py"]),
    Mutant("anchor-copy-unsettled", "the next version moves the mirror while the anchor copy is still being "
           "written from it",
           [("deltastore/publish/publisher.py", "            self.stages.anchor_copy.settle()  #", "            pass  #"),
            ("deltastore/publish/version.py", "        stages.anchor_copy.settle()\n", "        pass\n")],
           ["tests/test_anchor_copy.py"]),
    Mutant("failing-rank-raises-collective-error", "a rank whose own step failed raises the others' CollectiveError "
           "instead of its own error",
           [("deltastore/publish/collective.py", "        if mine is not None:\n            raise mine\n", "")],
           ["tests/test_publish_stages.py", "tests/test_distributed.py"]),
    Mutant("checked-target-ignores-addresses", "a pull reuses the last pull's target checks though a tensor moved "
           "to other memory or changed its element count",
           [("deltastore/pull/checked_target.py", " or facts != seen.facts",
             " or [f[:2] for f in facts] != [f[:2] for f in seen.facts]")],
           ["tests/test_checked_target.py"]),
    Mutant("checked-target-ignores-versions", "a pull reuses the last pull's target checks though a tensor was "
           "re-strided in place",
           [("deltastore/pull/checked_target.py", " or versions != seen.versions", "")],
           ["tests/test_checked_target.py"]),
    Mutant("checked-addresses-trust-subclasses", "a checked target's addresses are handed to the overlay though "
           "one of its tensors is a subclass (whose writes must go through torch ops)",
           [("deltastore/pull/checked_target.py", "        if hit is None or not hit.plain:", "        if hit is None:")],
           ["tests/test_checked_target.py"]),
    Mutant("has-delta-ignores-changed", "a version whose changed tensor has no delta counts as reachable by deltas",
           [("deltastore/manifest.py", "not any(map(_CHANGED, without)) or all(", "True or all(")],
           ["tests/test_core_units.py"]),
    Mutant("sorted-specs-kept-for-other-tensors", "the codecs' name check reuses the last sorted specs for "
           "another object's tensors of the same count",
           [("deltastore/_memo.py", " and len(last[0]) == len(items) and all(map(operator.is_, last[0], items)):",
             " and len(last[0]) == len(items):")],
           ["tests/test_codecs", "tests/test_decode_batch.py"]),
    Mutant("checked-addresses-kept-stale", "a pull hands its decoder the addresses a pull before it checked, "
           "after a tensor's memory moved",
           [("deltastore/pull/checked_target.py",
             "known.names is not hit.names or known.pointers is not hit.pointers", "known.names != hit.names")],
           ["tests/test_checked_target.py"]),
    Mutant("known-addresses-ignore-names", "the overlay offers every known address for a decoder's subset of "
           "the tensors",
           [("deltastore/pull/staging.py", "            elif names == known.names:\n", "            elif True:\n")],
           ["tests/test_checked_target.py"]),
    Mutant("rows-of-another-list", "the overlay takes a decoder's rows as the target's though they index another "
           "list of names",
           [("deltastore/pull/staging.py",
             '            if given is not None and self._table is not None and getattr(names, "table", None) is '
             'self._table:\n', "            if given is not None:\n")],
           ["tests/test_row_read_path.py"]),
    Mutant("publish-unserialised", "publish() from several threads runs concurrently (no lock)",
           [("deltastore/publish/publisher.py", "        with self._lock:\n            yield\n", "        yield\n")],
           ["tests/test_reliability/test_concurrent_use.py"]),
    Mutant("pull-target-unserialised", "pulls into one target from several threads or Subscribers run concurrently",
           [("deltastore/pull/subscriber.py", "        with self._lock, tracking.exclusive(target):",
             "        if True:")],
           ["tests/test_reliability/test_concurrent_use.py"]),
    Mutant("stream-holds-items", "a streamed publish holds live items for a later compare (no copy of small ones)",
           [("deltastore/publish/stream.py",
             "            piece[name] = t.detach().to(device=mirror.device, dtype=sp.dtype, copy=True)",
             "            piece[name] = t")],
           ["tests/test_publish_stream.py"]),
    Mutant("whole-stream-not-copied", "a stream captured whole keeps references to its items (no copies)",
           [("deltastore/publish/publisher.py", "            state = owned_items(state)", "            state = list(state)")],
           ["tests/test_publish_stream.py"]),
    Mutant("signature-unchecked", "a manifest whose bytes changed after signing is accepted (any signature of a "
           "trusted key id passes)",
           [("deltastore/signing.py", "if any(k.verify(signature, signed) for k in keys):", "if True:")],
           ["tests/test_backends/test_signed.py::test_tampered_manifest_refused",
            "tests/test_backends/test_signed.py::test_swapped_objects_refused"]),
    Mutant("unsigned-accepted", "an unsigned manifest passes a Subscriber with trusted keys",
           [("deltastore/signing.py", "        if record is None:\n            raise UnsignedVersionError(",
             "        if record is None:\n            return ''\n            raise UnsignedVersionError(")],
           ["tests/test_backends/test_signed.py::test_unsigned_versions_refused"]),
    Mutant("latest-may-go-back", "a follower accepts a signed refs/latest older than one it accepted before",
           [("deltastore/pull/latest.py", "if seen is not None and (signed.step < seen.step or signed.issued < seen.issued):",
             "if False:")],
           ["tests/test_backends/test_signed.py::test_replayed_latest_refused"]),
    Mutant("path-manifests-unchecked", "only the wanted version's manifest is checked, not the others on the path",
           [("deltastore/pull/reader.py", "        return plan_path(self.store.manifest_with_digest, step, current,",
             "        def unchecked(s, store=self.store):\n"
             "            if s == step:\n"
             "                return store.manifest_with_digest(s)\n"
             "            trust, store.trust = store.trust, None\n"
             "            try:\n"
             "                store.forget(s)\n"
             "                return store.manifest_with_digest(s)\n"
             "            finally:\n"
             "                store.trust = trust\n"
             "        return plan_path(unchecked, step, current,")],
           ["tests/test_backends/test_signed.py::test_tampered_delta_on_the_path_refused"]),
    Mutant("http-body-unbounded", "an http(s):// read takes a body past its bound (the manifest's size + 1)",
           [("deltastore/backends/http.py", "cap + 1 if declared is None else min(cap + 1, declared)",
             "(1 << 40) if declared is None else min(cap + 1, declared)")],
           ["tests/test_backends/test_http_hostile.py::test_endless_body_memory_is_bounded",
            "tests/test_backends/test_http_hostile.py::test_hostile_object_answers"]),
    Mutant("http-no-speed-floor", "an http(s):// body has no deadline: a trickling server holds a pull for ever",
           [("deltastore/backends/http.py",
             "            _WATCHDOG.arm(token, started + self.read_timeout + (len(body) + want) / self.min_speed)",
             "            token.disarm()")],
           ["tests/test_backends/test_http_hostile.py::test_hostile_object_answers[trickled-body]"]),
    Mutant("http-weak-etag-trusted", "a file server's mtime+size ETag is used as a validator even when made in the "
           "second its bytes were written (a same-size rewrite in that second is missed)",
           [("deltastore/backends/http.py", "    if modified is None:\n        return True",
             "    if True:\n        return True")],
           ["tests/test_backends/test_http.py::TestNginxConformance::test_reads",
            "tests/test_backends/test_http.py::test_polling_uses_conditional_gets"]),
    Mutant("index-digest-unchecked", "a reader without listing takes a manifest whose bytes are not those the index "
           "names", [("deltastore/store.py", "        self._check_indexed(step, digest)\n", "")],
           ["tests/test_backends/test_http_hostile.py::test_tampered_manifest_against_the_index"]),
    Mutant("mirror-manifest-first", "the mirror writes a version's manifest before its objects",
           [("deltastore/store_mirror.py", "        missing = [(d, n) for d, n in refs.items() if not self.dst.has_object(d)]",
             "        self.dst.backend.put(version_key(item.step), data, mode=\"create\")\n"
             "        missing = [(d, n) for d, n in refs.items() if not self.dst.has_object(d)]")],
           ["tests/test_mirror.py::test_tampered_source_copies_nothing_of_that_version"]),
    Mutant("mirror-objects-unverified", "the mirror copies objects without checking them against their digest",
           [("deltastore/store_mirror.py", "            body = self.src.get_object(digest, size)",
             "            body = self.src.backend.get(object_key(digest))")],
           ["tests/test_mirror.py::test_tampered_source_copies_nothing_of_that_version"]),
    # issue 48: four plausible bugs the rest of the suite let through (tests/test_reliability/test_false_claims.py)
    Mutant("differential-base-by-step", "the planner takes a differential from the target when the target holds "
           "its base's step, whatever that version's digest (a joiner of a rewritten store)",
           [("deltastore/pull/planner.py", "    if current is not None and current == base:",
             "    if current is not None and current.step == base.step:")],
           [FALSE + "test_a_differential_on_another_version_of_the_held_step_is_not_planned",
            FALSE + "test_a_joiner_holding_a_rewritten_step_gets_the_new_anchor_not_a_differential_on_its_own"]),
    Mutant("layout-backup-aliases-target", "a layout change's backup of a target tensor it copies a new tensor "
           "into is the tensor itself on the host (a failure later restores nothing)",
           [("deltastore/pull/apply.py", '        if fits(t, spec):\n            flat = bits_view(t)\n'
                                    '            backup = flat.to("cpu", copy=True)\n',
             '        if fits(t, spec):\n            flat = bits_view(t)\n            backup = flat.to("cpu")\n')],
           [FALSE + "test_a_failed_layout_change_restores_a_tensor_it_had_copied_whole"]),
    Mutant("anchor-failure-keeps-version", "a failed anchor pull whose restore was refused leaves the target "
           "claiming the version it held before",
           [("deltastore/pull/transaction.py", "self._track(self.current if restored_by(e, refused) else None)",
             "self._track(self.current)")],
           [FALSE + "test_a_refused_restore_after_an_anchor_failure_leaves_a_tracked_target_unknown"]),
    Mutant("retried-create-trusts-presence", "a create-only put retried after a transient error takes a key it "
           "finds present as its own earlier try (a rival's commit becomes ours)",
           [("deltastore/backends/retry.py", "if self.inner.get(key) == bytes(data):",
             "if self.inner.exists(key):")],
           [FALSE + "test_a_rivals_create_is_not_taken_as_our_commit_on_retry"]),
]


def copy_tree(dest: Path, rev: str | None) -> None:
    """The repository's files into ``dest``: ``rev``'s tree, or the working tree's tracked and untracked
    (not ignored) files; never a virtualenv."""
    if rev is not None:
        archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if rel.startswith(".venv") or not src.is_file():
            continue  # a venv, or a tracked file deleted in the working tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


KERNEL_SOURCES = (".pyx", ".pxd", ".h")


def build(copy: Path) -> None:
    """Compile the kernels in the copy (``setup.py build_ext --inplace``): the working tree's builds are ignored
    files, never copied, and a mutant of a kernel source needs its own build. Cython comes from this
    environment or, where it has none, is installed into the copy first (``pip --target``)."""
    env = env_for(copy)
    if subprocess.run([sys.executable, "-c", "import Cython"], env=env, capture_output=True).returncode != 0:
        if not (copy / ".cython").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(copy / ".cython"),
                            "Cython>=3.0.11"], check=True)
        env["PYTHONPATH"] = f"{copy / '.cython'}{os.pathsep}{env['PYTHONPATH']}"
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=copy, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"building the kernels in {copy} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")


def env_for(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(copy), "DELTASTORE_TRACES": str(TRACES), "DELTASTORE_STRICT": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def check_import(copy: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "import deltastore; print(deltastore.__file__)"], cwd=copy,
                         env=env_for(copy), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"deltastore is imported from {out}, not from the copy {copy}: mutants would test nothing")
    return out


def run_tests(copy: Path, args: list[str]) -> tuple[int, list[str], float, str]:
    """(exit status, failed test ids, seconds, output tail) of pytest on ``args`` in the copy."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args],
                          cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=1800)
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", proc.stdout, flags=re.M)
    return proc.returncode, failed, time.monotonic() - t0, proc.stdout[-3000:] + proc.stderr[-2000:]


def apply(copy: Path, m: Mutant) -> dict[Path, str]:
    """Make ``m``'s edits in the copy; the files' original texts (for :func:`restore`)."""
    originals: dict[Path, str] = {}
    for rel, old, new in m.edits:
        path = copy / rel
        text = path.read_text()
        originals.setdefault(path, text)
        n = text.count(old)
        if n != 1:
            restore(originals)
            raise SystemExit(f"mutant {m.name}: {old!r} occurs {n} times in {rel} (expected once): update the mutant")
        path.write_text(text.replace(old, new))
    return originals


def restore(originals: dict[Path, str]) -> None:
    for path, text in originals.items():
        path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all): " + ", ".join(m.name for m in MUTANTS))
    ap.add_argument("--rev", help="copy this git revision instead of the working tree")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    opts = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not opts.names or m.name in opts.names]
    unknown = set(opts.names) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants {sorted(unknown)}")
    copy = Path(tempfile.mkdtemp(prefix="deltastore-mutants-"))
    t_start = time.monotonic()
    try:
        copy_tree(copy, opts.rev)
        build(copy)
        rev = opts.rev or "working tree"
        head = subprocess.run(["git", "rev-parse", "--short", opts.rev or "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        print(f"copy of {rev} ({head}) in {copy}; deltastore imported from {check_import(copy)}", flush=True)
        if not opts.no_baseline:
            every = sorted({t for m in chosen for t in m.tests})
            status, failed, secs, tail = run_tests(copy, every)
            if status != 0:
                print(f"baseline failed (exit {status}) before any mutation: {failed}\n{tail}")
                return 2
            print(f"baseline: the unmutated copy passes {len(every)} test files/ids in {secs:.0f} s", flush=True)
        survived = []
        for m in chosen:
            kernel = any(rel.endswith(KERNEL_SOURCES) for rel, _, _ in m.edits)
            originals = apply(copy, m)
            try:
                if kernel:
                    build(copy)
                status, failed, secs, tail = run_tests(copy, m.tests)
            finally:
                restore(originals)
                if kernel:
                    build(copy)
            m.caught_by = failed
            # pytest killed by a signal (a mutant writing through stale addresses can crash it) lists no failed
            # test, but the suite fails all the same
            crashed = status < 0
            caught = status != 0 and (bool(failed) or crashed)
            if not caught:
                survived.append(m)
            verdict = (f"CAUGHT by {len(failed)} test(s)" if failed else f"CAUGHT (pytest killed by signal {-status})"
                       ) if caught else f"SURVIVED (pytest exit {status})"
            print(f"\nmutant {m.name}: {m.what}\n  {verdict} in {secs:.0f} s", flush=True)
            for t in failed[:8]:
                print(f"    {t}")
            if len(failed) > 8:
                print(f"    ... and {len(failed) - 8} more")
            if not caught:
                print(tail)
        print(f"\n{len(chosen) - len(survived)} of {len(chosen)} mutants caught "
              f"({time.monotonic() - t_start:.0f} s)")
        return 1 if survived else 0
    finally:
        if opts.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
