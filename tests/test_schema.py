"""`sftctl schema`: the job spec's JSON Schema for editors, and docs/spec.md made from it.

The schema describes the spec as written (short forms included), so it must accept what
`load_spec` accepts and refuse what it refuses, for every form a schema can express."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, no_traceback, sftctl

try:  # not a dependency of sftctl: validation is checked where it is installed (moto's server brings it)
    import jsonschema
except ImportError:  # pragma: no cover - the key fields are still checked below
    jsonschema = None
needs_jsonschema = pytest.mark.skipif(jsonschema is None, reason="jsonschema is not installed")

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema_doc() -> dict:
    proc = sftctl("schema", check=True)
    doc = json.loads(proc.stdout)
    if jsonschema is not None:
        jsonschema.Draft7Validator.check_schema(doc)  # yaml-language-server reads draft-07 and below
    return doc


def _errors(schema_doc: dict, spec: dict) -> list[str]:
    return [e.message for e in jsonschema.Draft7Validator(schema_doc).iter_errors(spec)]


def _loads(tmp_path: Path, spec: dict) -> bool:
    """Whether sftctl itself loads the spec (written as a file beside nothing else)."""
    from sftctl.errors import SpecError
    from sftctl.spec import load_spec

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    try:
        load_spec(path, environ={})
    except SpecError:
        return False
    return True


def test_the_schema_names_the_spec_models_fields(schema_doc):
    assert schema_doc["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema_doc["required"] == ["run"]  # name defaults to the file's name
    assert schema_doc["additionalProperties"] is False
    assert {"name", "model", "train", "resources", "env", "run", "health", "storage"} <= set(schema_doc["properties"])
    assert set(schema_doc["definitions"]) >= {"ModelSpec", "TrainSpec", "ResourcesSpec", "HealthSpec"}
    steps = schema_doc["definitions"]["TrainSpec"]["properties"]["steps"]
    assert (steps["type"], steps["default"], steps["exclusiveMinimum"]) == ("integer", 100, 0)
    assert "$defs" not in json.dumps(schema_doc)  # draft-07: definitions
    accelerators = schema_doc["definitions"]["ResourcesSpec"]["properties"]["accelerators"]
    assert accelerators["anyOf"][0]["anyOf"][0]["type"] == "string"  # H100:8, as a spec writes it


@needs_jsonschema
def test_the_schema_accepts_every_example(schema_doc):
    assert len(EXAMPLES) >= 4
    for path in EXAMPLES:
        assert _errors(schema_doc, yaml.safe_load(path.read_text())) == [], path.name


WRONG = {
    "a top-level steps (it is train.steps)": {"steps": 10},
    "no nodes": {"resources": {"nodes": 0}},
    "a count that is not a number": {"resources": {"accelerators": ["H100:x"]}},
    "a dtype sftctl does not know": {"model": {"entrypoint": "m.py:build", "dtype": "fp8"}},
    "steps as text": {"train": {"steps": "ten"}},
    "a deadline without a unit": {"resources": {"deadline": "2 days"}},
    "an attention kernel sftctl does not know": {"model": {"entrypoint": "m.py:build", "attention": "flashy"}},
    "a misspelt field": {"resources": {"acelerators": ["cpu:1"]}},
    "a cloud sftctl does not know": {"resources": {"clouds": ["azure"]}},
    "a name with capitals": {"name": "MyJob"},
}


@needs_jsonschema
@pytest.mark.parametrize("what", list(WRONG))
def test_a_wrong_spec_fails_the_schema_as_it_fails_sftctl(schema_doc, tmp_path, what):
    (tmp_path / "m.py").write_text("def build():\n    pass\n")
    spec = {"run": "true", **WRONG[what]}
    assert _errors(schema_doc, spec) != []
    assert not _loads(tmp_path, spec)
    assert _errors(schema_doc, {"run": "true"}) == [] and _loads(tmp_path, {"run": "true"})


RIGHT = {
    "one accelerator as text": {"resources": {"accelerators": "cpu:1"}},
    "accelerators as mappings": {"resources": {"accelerators": [{"name": "cpu", "count": 1}]}},
    "spot as its policy": {"resources": {"spot": {"fallback_on_demand_after": 2, "zone_cooldown": "30m"}}},
    "storage as a URL": {"storage": "s3://bucket/prefix"},
    "env and labels values as numbers and booleans": {"env": {"OMP_NUM_THREADS": 1, "DEBUG": True},
                                                     "labels": {"lr": 0.001}},
    "a deadline": {"resources": {"deadline": "90m"}},
    "a health threshold": {"health": {"interval_s": 5}},
}


@needs_jsonschema
@pytest.mark.parametrize("what", list(RIGHT))
def test_the_short_forms_sftctl_accepts_pass_the_schema(schema_doc, tmp_path, what):
    spec = {"run": "true", **RIGHT[what]}
    assert _loads(tmp_path, spec)
    assert _errors(schema_doc, spec) == []


def test_output_writes_the_file_and_a_bad_path_is_one_line(tmp_path, schema_doc):
    out = tmp_path / "spec.schema.json"
    proc = sftctl("schema", "--output", str(out), check=True)
    assert proc.stdout == "" and f"wrote {out}" in proc.stderr
    assert json.loads(out.read_text()) == schema_doc
    bad = sftctl("schema", "--output", str(tmp_path / "missing" / "x.json"))
    assert bad.returncode == 2 and no_traceback(bad)
    assert bad.stderr.splitlines()[0] == f"error: --output {tmp_path / 'missing' / 'x.json'}: cannot write it: " \
                                         "No such file or directory"


def test_docs_spec_md_is_the_schemas_reference_and_current(schema_doc):
    from sftctl import schema

    text = schema.markdown()
    assert (REPO / "docs" / "spec.md").read_text() == text, \
        "docs/spec.md is stale: sftctl schema --markdown --output docs/spec.md"
    assert sftctl("schema", "--markdown", check=True).stdout == text
    # every field of every section is a row, under the section of its path
    sections = text.split("\n## ")
    assert sections[1].startswith("top level\n")
    for field in schema_doc["properties"]:
        assert f"| `{field}` |" in sections[1], field
    resources = next(s for s in sections if s.startswith("resources\n"))
    for field in schema_doc["definitions"]["ResourcesSpec"]["properties"]:
        assert f"| `{field}` |" in resources, field
    assert "| `run` | string, not empty | **required** |" in sections[1]
    assert "| `steps` | integer (> 0, <= 1,000,000,000,000) | `100` |" in text
