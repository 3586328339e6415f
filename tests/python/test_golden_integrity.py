"""Goldens loaded by name are the manifest's: an edited file is an error naming it (unless
verify=False), a name is a case name and never a path, a manifest naming files outside its
folder is refused, and the manifest is read under the bounded rules (k3ref._bounded)."""
import json
import os
import shutil

import pytest

from k3ref import goldens

from conftest import GOLDENS

CASE = "kda_t1"


@pytest.fixture
def suite(tmp_path):
    """A golden folder of one case and its manifest entry, copied from the committed suite."""
    manifest = json.loads((GOLDENS / "MANIFEST.json").read_text())
    manifest["cases"] = [c for c in manifest["cases"] if c["name"] == CASE]
    (tmp_path / "MANIFEST.json").write_text(json.dumps(manifest))
    shutil.copy(GOLDENS / f"{CASE}.safetensors", tmp_path)
    return tmp_path


def test_an_unchanged_golden_loads(suite):
    assert goldens.load_case(CASE, suite).name == CASE
    assert [c.name for c in goldens.load_suite(suite)] == [CASE]


def test_an_edited_golden_is_an_error_naming_the_file(suite):
    path = suite / f"{CASE}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last output value
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{CASE}.safetensors: sha256 differs from MANIFEST.json"):
        goldens.load_case(CASE, suite)
    with pytest.raises(ValueError, match="sha256 differs"):
        goldens.load_suite(suite)
    assert goldens.load_case(CASE, suite, verify=False).name == CASE


@pytest.mark.parametrize("name", ["../outside/evil", "/etc/passwd", "a/b", "..", "", "x" * 201, "kda t1"])
def test_a_name_is_never_a_path(suite, name):
    with pytest.raises(ValueError, match="is not a case name"):
        goldens.load_case(name, suite)


def test_a_case_missing_from_the_manifest_is_not_loaded(suite):
    shutil.copy(GOLDENS / "kda_t100.safetensors", suite)
    with pytest.raises(FileNotFoundError, match="no case 'kda_t100' in"):
        goldens.load_case("kda_t100", suite)


def test_a_manifest_naming_files_outside_its_folder_is_refused(suite):
    m = json.loads((suite / "MANIFEST.json").read_text())
    m["cases"][0]["name"] = "../outside/evil"
    (suite / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="is not a case name"):
        goldens.load_suite(suite)


def test_the_manifest_is_read_under_the_bounded_rules(suite):
    path = suite / "MANIFEST.json"
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        goldens.case_names(suite)
    path.unlink()
    path.write_text('{"cases": [], "cases": []}')
    with pytest.raises(ValueError, match="duplicate key 'cases'"):
        goldens.case_names(suite)
    path.write_text("[" * 1000 + "]" * 1000)
    with pytest.raises(ValueError, match="nested more than"):
        goldens.case_names(suite)
