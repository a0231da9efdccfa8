"""environment.yml parses, every spec in it is valid, and its pins agree with pyproject's (offline)."""

import re
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement

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
        if spec.strip() == "-e .":
            continue
        try:
            Requirement(spec)
        except InvalidRequirement as err:
            pytest.fail(f"not a pip requirement: {spec!r} ({err})")


def test_pins_agree_with_pyproject():
    conda, pip = env_specs()
    python = next(s.split("=", 1)[1] for s in conda if s.startswith("python="))
    ours = pinned([Requirement(s) for s in pip if s.strip() != "-e ."], python)
    expected = pinned(requirement_file("requirements.txt") + requirement_file("requirements-test.txt"), python)
    assert ours == expected
    assert all(spec.startswith("==") for spec in expected.values()), "every dependency is pinned exactly"


def test_pyproject_reads_the_requirement_files():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dynamic = project["tool"]["setuptools"]["dynamic"]
    assert dynamic["dependencies"]["file"] == ["requirements.txt"]
    assert dynamic["optional-dependencies"]["test"]["file"] == ["requirements-test.txt"]
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().split()
