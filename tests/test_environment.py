"""environment.yml parses and pins what constraints.txt pins; pyproject.toml declares ranges that hold the pins
(offline)."""

import re
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

# A conda match spec: [channel::]name[ version-spec[ build]], where the version spec is
# '=1.2', '1.2.*', '>=1,<2', '==1.2.3', ... (simplified from conda's MatchSpec grammar).
_VERSION = r"[0-9A-Za-z_.*+!]+"
_CONSTRAINT = rf"(==|=|>=|<=|>|<|!=|~=)?{_VERSION}"
CONDA_SPEC = re.compile(rf"^([A-Za-z0-9_.-]+::)?[a-z0-9_][a-z0-9_.-]*"
                        rf"(\s*{_CONSTRAINT}(\s*[,|]\s*{_CONSTRAINT})*(\s+[A-Za-z0-9_.*]+)?)?$")


def is_conda_spec(spec: str) -> bool:
    return bool(CONDA_SPEC.match(spec.strip()))


def load_env():
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def pinned(requirements, python="3.11"):
    """{name: specifier} for the requirements that apply on the given Python."""
    env = dict(default_environment(), python_version=python, python_full_version=f"{python}.0")
    return {r.name.lower(): str(r.specifier) for r in requirements
            if r.marker is None or r.marker.evaluate(env)}


def requirement_file(name):
    """Requirements in a pip requirements file; a '#' after whitespace starts a comment, as for pip."""
    lines = (re.sub(r"(^|\s)#.*$", "", line).strip() for line in (ROOT / name).read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def env_specs():
    deps = load_env()["dependencies"]
    conda = [d for d in deps if isinstance(d, str)]
    pip = [x for d in deps if isinstance(d, dict) for x in d.get("pip", [])]
    return conda, pip


@pytest.mark.parametrize("spec, ok", [("python=3.11", True), ("numpy >=1.2,<2", True), ("conda-forge::pip", True),
                                      ("pytorch 2.1.* *cuda*", True), ("numpy=", False), ("Bad Name", False)])
def test_conda_spec_checker_itself(spec, ok):
    assert is_conda_spec(spec) is ok


def test_environment_yml_parses_with_name_channels_and_dependencies():
    env = load_env()
    assert env["name"] == "gpukit"
    assert env["channels"] and env["dependencies"]


def test_every_spec_is_a_valid_conda_match_spec_or_pip_requirement():
    conda, pip = env_specs()
    assert conda and pip
    bad = [s for s in conda if not is_conda_spec(s)]
    assert not bad, f"not conda match specs: {bad}"
    for spec in pip:
        if spec.strip().startswith("-e ."):
            continue
        try:
            Requirement(spec)
        except InvalidRequirement as err:
            pytest.fail(f"not a pip requirement: {spec!r} ({err})")


def lock():
    return requirement_file("constraints.txt")


def declared():
    """pyproject's dependencies and every extra of it (kit.py's .venv installs them all)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(s) for s in project["dependencies"] + [r for name in extras for r in extras[name]]]


def test_environment_yml_pins_what_the_lock_pins():
    conda, pip = env_specs()
    python = next(s.split("=", 1)[1] for s in conda if s.startswith("python="))
    ours = pinned([Requirement(s) for s in pip if not s.strip().startswith("-e .")], python)
    assert ours == pinned(lock(), python)


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12"])
def test_the_lock_pins_every_dependency_exactly_within_pyprojects_ranges(python):
    pins = pinned(lock(), python)
    ranges = pinned(declared(), python)
    assert set(pins) == set(ranges), "constraints.txt and pyproject.toml name different packages"
    assert all(spec.startswith("==") for spec in pins.values()), "every line of the lock is an exact pin"
    for name, spec in pins.items():
        assert SpecifierSet(ranges[name]).contains(spec[2:]), f"{name}{spec} is outside pyproject's {ranges[name]}"


def test_pyproject_declares_ranges_not_pins():
    exact = [str(r) for r in declared() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not exact, f"a library must not pin (installing it would replace what an environment has): {exact}"


def test_the_torch_range_is_the_one_contributing_says_was_tested():
    torch = next(r for r in declared() if r.name == "torch")
    readme = (ROOT / "CONTRIBUTING.md").read_text()
    # rows such as "| torch 2.11.0 | 2.11.0+cu130 from PyPI ... | 190 passed, 2 skipped |", with no failure
    tested = [v for v, row in re.findall(r"^\| torch (\d+\.\d+\.\d+) \|(.*)$", readme, re.M)
              if re.search(r"\d+ passed", row) and not re.search(r"\d+ (failed|error)", row)]
    assert len(tested) >= 2, "CONTRIBUTING.md's table of tested torch versions is missing"
    oldest = min(tested, key=Version)
    assert all(torch.specifier.contains(v) for v in tested)
    # the range runs from the oldest tested release series to the newest: none before or after is allowed
    major, minor, _ = Version(oldest).release
    assert not torch.specifier.contains(f"{major}.{minor - 1}.0")
    major, minor, _ = max((Version(v) for v in tested)).release
    assert not torch.specifier.contains(f"{major}.{minor + 1}.0")


def test_environment_yml_installs_gpukit_with_every_extra_as_kit_py_does():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    _, pip = env_specs()
    editable = [s.strip() for s in pip if s.strip().startswith("-e .")]
    assert editable == [f"-e .[{','.join(extras)}]"]
    assert f'[{",".join(extras)}]' in (ROOT / "kitlib" / "venv.py").read_text()  # kit.py's set-up
