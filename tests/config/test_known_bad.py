"""Installed dependency versions known to break a path (omni/known_bad.py) are refused at
validation, naming each package, its installed version and the fix.

The installed versions are faked (a version lookup passed to the check, or at validation in
place of the metadata lookup): these tests cannot install old releases. Each entry was also
checked by hand against the real broken releases (the entry's `why` names the public issue).
"""

import pytest

from omni import known_bad
from omni.known_bad import KNOWN_BAD, check_known_bad, installed_version, known_bad_problems
from omni.validation import ConfigError, to_schema, validate
from tests.conftest import compose_config

# For each entry: the model option of a run that takes its path, one that does not (None:
# every run does), and installed versions that match it.
CASES = {
    "peft": ("sd3_tiny", None, {"peft": "0.18.0", "transformers": "4.51.3"}),
    "diffusers": ("qwen_image_tiny", "sd3_tiny", {"diffusers": "0.36.0"}),
}


def entry(name):
    (found,) = [e for e in KNOWN_BAD if next(iter(e.versions)) == name]
    return found


def config(model):
    return to_schema(compose_config([f"model={model}"]))


def fake_versions(versions):
    """A fake of the installed-version lookup: `versions`, and the real version of any other package."""
    return lambda package: versions.get(package, installed_version(package))


def test_every_entry_has_a_case_and_a_public_issue():
    assert {next(iter(e.versions)) for e in KNOWN_BAD} == set(CASES)
    assert all("#" in e.why and e.fix.startswith("pip install") for e in KNOWN_BAD)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_installed_bad_version_is_refused_naming_package_version_and_fix(name):
    model, _, versions = CASES[name]
    with pytest.raises(ConfigError) as error:
        check_known_bad(config(model), fake_versions(versions))
    message = str(error.value)
    for package, version in versions.items():
        assert f"{package} {version}" in message
    assert f"Fix: {entry(name).fix}" in message
    assert entry(name).path in message


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_entry_needs_every_package_to_match_and_its_path_taken(name):
    model, other_model, versions = CASES[name]
    fixed = {package: "99.0" for package in versions}
    assert known_bad_problems(config(model), fake_versions(fixed), [entry(name)]) == []
    for package in versions:  # one package at a good version is enough
        assert known_bad_problems(config(model), fake_versions({**versions, package: "99.0"}), [entry(name)]) == []
    if other_model is not None:  # a run that does not take the path is not refused
        assert known_bad_problems(config(other_model), fake_versions(versions), [entry(name)]) == []


def test_fake_missing_package_or_development_build_is_not_matched():
    cfg = config("qwen_image_tiny")
    assert known_bad_problems(cfg, fake_versions({"diffusers": None}), [entry("diffusers")]) == []
    assert known_bad_problems(cfg, fake_versions({"diffusers": "0.36.0.dev0"}), [entry("diffusers")]) == []
    assert known_bad_problems(cfg, fake_versions({"diffusers": "not-a-version"}), [entry("diffusers")]) == []


@pytest.mark.parametrize("model", ["sd3_tiny", "flux_tiny", "qwen_image_tiny", "wan_tiny"])
def test_installed_versions_pass(model):
    assert known_bad_problems(config(model)) == []


def test_fake_bad_version_stops_validation_before_any_other_rule(monkeypatch):
    """validate() runs the check first: with a faked installed diffusers 0.36 a Qwen-Image run
    is refused, even with a cross-group error in the config (a resolution the model cannot take)."""
    monkeypatch.setattr(known_bad, "installed_version", fake_versions({"diffusers": "0.36.0"}))
    with pytest.raises(ConfigError, match="known-bad dependencies: diffusers 0.36.0 installed"):
        validate(compose_config(["model=qwen_image_tiny", "rollout.resolution=72"]))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="rollout.resolution=72"):
        validate(compose_config(["model=qwen_image_tiny", "rollout.resolution=72"]))
