"""The job spec: valid files load; every mistake is one SpecError naming the field and line."""

from __future__ import annotations

import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, no_traceback, sftctl, write_spec
from sftctl.errors import SftctlError, SpecError
from sftctl.spec import load_spec, parse_duration_s, resolve_env


def err(tmp_path, text: str, overrides=(), environ=None, name="job.yaml") -> str:
    path = write_spec(tmp_path / name, text)
    with pytest.raises(SpecError) as e:
        load_spec(path, overrides, environ={} if environ is None else environ)
    assert e.value.exit_code == 2
    return e.value.message.replace(f"{tmp_path}/", "")


def test_quickstart_loads():
    spec = load_spec(REPO / "examples" / "quickstart.yaml")
    assert spec.name == "quickstart"
    assert spec.workdir == str(REPO)
    assert spec.resources.nodes == 2
    assert spec.model.entrypoint == "examples/gpt/model.py:build"
    assert spec.env["OMP_NUM_THREADS"] == "1"


def test_unknown_key_names_line_and_suggests(tmp_path):
    msg = err(tmp_path, "name: demo\nresources:\n  nodes: 2\n  acelerators: [H100:8]\nrun: echo\n")
    assert msg == "job.yaml:4: resources.acelerators: unknown field; did you mean 'accelerators'?"


def test_unknown_top_level_key(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\nrecovry:\n  max_restarts: 1\n")
    assert msg == "job.yaml:3: recovry: unknown field; did you mean 'recovery'?"


def test_wrong_type_names_line(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\ntrain:\n  checkpoint_interval: 5\n  steps: lots\n")
    assert msg.startswith("job.yaml:5: train.steps: Input should be a valid integer")
    assert "'lots'" in msg


def test_missing_entrypoint_names_model_line(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\nmodel:\n  framework: torch\n")
    assert msg == "job.yaml:3: model.entrypoint: required field is missing"


def test_entrypoint_file_must_exist(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\nmodel:\n  entrypoint: nope.py:build\n")
    assert msg.startswith("job.yaml:4: model.entrypoint: nope.py not found in workdir")


def test_entrypoint_form(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\nmodel:\n  entrypoint: train\n")
    assert "job.yaml:4: model.entrypoint: expected 'file.py:function'" in msg


def test_missing_run(tmp_path):
    assert err(tmp_path, "name: demo\n") == "job.yaml:1: run: required field is missing"


def test_malformed_yaml_names_line(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\nresources:\n  nodes: 2\n   spot: true\n")
    assert msg.startswith("job.yaml:5: malformed YAML")


def test_duplicate_key(tmp_path):
    assert err(tmp_path, "name: a\nrun: echo\nname: b\n") == "job.yaml:3: name: duplicate key"


def test_top_level_must_be_mapping(tmp_path):
    assert "must be a mapping" in err(tmp_path, "- a\n- b\n")
    assert "empty" in err(tmp_path, "# nothing\n")


def test_recursive_alias_is_an_error(tmp_path):
    assert "recursive YAML alias" in err(tmp_path, "name: demo\nrun: echo\nenv: &a {x: *a}\n")


def test_interpolation(tmp_path):
    path = write_spec(
        tmp_path / "job.yaml",
        "name: demo\nrun: echo ${NOT_TOUCHED}\nenv:\n  A: ${HOMEDIR}/x\n  B: ${MISSING:-fallback}\n  C: $${LITERAL}\n",
    )
    spec = load_spec(path, environ={"HOMEDIR": "/h"})
    # env keeps the references (state never holds an environment value); a node gets them resolved
    assert spec.env == {"A": "${HOMEDIR}/x", "B": "${MISSING:-fallback}", "C": "$${LITERAL}"}
    assert resolve_env(spec.env, {"HOMEDIR": "/h"}) == {"A": "/h/x", "B": "fallback", "C": "${LITERAL}"}
    assert spec.run == "echo ${NOT_TOUCHED}"  # the node's shell expands run and setup


def test_unset_variable_names_line(tmp_path):
    msg = err(tmp_path, "name: demo\nrun: echo\nenv:\n  TOKEN: ${HF_TOKEN}\n")
    assert msg == "job.yaml:4: env.TOKEN: ${HF_TOKEN} is not set in the environment"


def test_set_overrides_are_typed_and_validated(tmp_path):
    path = write_spec(tmp_path / "job.yaml", "name: demo\nrun: echo\nresources:\n  accelerators: [cpu]\n")
    spec = load_spec(
        path,
        ["train.steps=20", "resources.spot=true", "resources.accelerators.0=cpu:2", "run=echo a: b",
         "env.X=3"],
        environ={},
    )
    assert spec.train.steps == 20 and spec.resources.spot is True
    assert (spec.resources.accelerators[0].name, spec.resources.accelerators[0].count) == ("cpu", 2)
    assert spec.run == "echo a: b" and spec.env == {"X": "3"}


def test_set_a_storage_field_over_a_storage_string(tmp_path):
    path = write_spec(tmp_path / "job.yaml", "name: demo\nrun: echo\nstorage: s3://b/p\n")
    spec = load_spec(path, ["storage.create_bucket=true"], environ={})
    assert spec.storage.url == "s3://b/p" and spec.storage.create_bucket is True
    spec = load_spec(path, ["storage=/tmp/x", "storage.max_workdir_mb=5"], environ={})
    assert spec.storage.url == "/tmp/x" and spec.storage.max_workdir_mb == 5



def test_a_relative_storage_directory_is_the_spec_files_or_the_shells(tmp_path, monkeypatch):
    """`storage: relstore` was handed to the nodes as written: the controller wrote the workdir
    under <cwd>/relstore, the node looked in its own directory's relstore, and the job hung. In
    the file it is relative to the file's directory (as workdir is); from SFTCTL_STORAGE or
    --set, to the current directory."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "shell").mkdir()
    monkeypatch.chdir(tmp_path / "shell")
    monkeypatch.delenv("SFTCTL_STORAGE", raising=False)
    for text in ("storage: relstore\n", "storage: {url: ./relstore}\n"):
        path = write_spec(tmp_path / "specs" / "st.yaml", "name: st\nrun: echo\n" + text)
        assert load_spec(path, environ={}).storage.url == str(tmp_path / "specs" / "relstore")
        assert load_spec(path, ["storage.create_bucket=true"], environ={}).storage.url == \
            str(tmp_path / "specs" / "relstore")
        for override in ("storage=other", "storage.url=other"):
            assert load_spec(path, [override], environ={}).storage.url == str(tmp_path / "shell" / "other")
    bare = write_spec(tmp_path / "specs" / "bare.yaml", "name: bare\nrun: echo\n")
    monkeypatch.setenv("SFTCTL_STORAGE", "relstore")
    assert load_spec(bare, environ={}).storage.url == str(tmp_path / "shell" / "relstore")
    for url in ("s3://b/p", "/abs/store", "file:///abs/store"):  # as written
        assert load_spec(bare, [f"storage={url}"], environ={}).storage.url == url


def test_a_relative_defaults_storage_is_the_config_files(tmp_path, monkeypatch):
    """The config file's `defaults: {storage: ckpts}` was taken from the current directory: each
    directory a user ran from got its own ckpts/ (and a job's checkpoints were not where the last
    one's were). It is relative to the config file's directory, as kubeconfig's paths are."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "shell").mkdir()
    conf = tmp_path / "conf" / "config.yaml"
    conf.write_text("defaults: {storage: ckpts}\n")
    monkeypatch.setenv("SFTCTL_CONFIG", str(conf))
    monkeypatch.delenv("SFTCTL_STORAGE", raising=False)
    monkeypatch.chdir(tmp_path / "shell")
    bare = write_spec(tmp_path / "bare.yaml", "name: bare\nrun: echo\n")
    assert load_spec(bare, environ={}).storage.url == str(tmp_path / "conf" / "ckpts")
    monkeypatch.setenv("SFTCTL_STORAGE", "envstore")  # the environment's: the shell's directory
    assert load_spec(bare, environ={}).storage.url == str(tmp_path / "shell" / "envstore")


def test_a_job_with_a_relative_storage_directory_succeeds(tmp_path, home, monkeypatch):
    """The user's repro: `sftctl run st.yaml` with `storage: relstore` stayed RUNNING for ever."""
    monkeypatch.delenv("SFTCTL_STORAGE", raising=False)
    write_spec(tmp_path / "st.yaml", "name: st\nrun: echo hi from the node\nstorage: relstore\n")
    proc = sftctl("run", "st.yaml", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "hi from the node" in proc.stdout
    # the storage's marker, the job's checkpoint folder (st-<id>) and the workdir bundles the
    # nodes fetched, in the directory the spec named (iterdir's order is the filesystem's: CI
    # listed workdir first)
    names = sorted(p.name for p in (tmp_path / "relstore").iterdir())
    assert len(names) == 3 and names[1].startswith("st-"), names
    assert [names[0], names[2]] == [".sftctl-storage.json", "workdir"], names


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=1", "--set train.stepz=1: train.stepz: unknown field; did you mean 'steps'?"),
        ("train.steps=-3", "--set train.steps=-3: train.steps: Input should be greater than 0 (got -3)"),
        ("train.steps", "--set train.steps: expected key.path=value"),
        ("run.x=1", "--set run.x=1: run is not a mapping"),
        ("resources.accelerators.5=cpu", "--set resources.accelerators.5=cpu: resources.accelerators[5]: index 5 is out of range (the list has 1 items)"),
    ],
)
def test_set_errors(tmp_path, override, expected):
    text = "name: demo\nrun: echo\nresources:\n  accelerators: [cpu]\n"
    assert err(tmp_path, text, [override]) == expected


def test_durations():
    assert parse_duration_s("90m") == 5400 and parse_duration_s("2d") == 172800
    with pytest.raises(ValueError):
        parse_duration_s("soon")


def test_cli_spec_error_is_one_line_exit_2(tmp_path, home):
    path = write_spec(tmp_path / "job.yaml", "name: demo\nrun: echo\ntrain:\n  stpes: 3\n")
    proc = sftctl("run", str(path))
    assert proc.returncode == 2
    assert no_traceback(proc)
    assert f"{path}:4: train.stpes: unknown field; did you mean 'steps'?" in " ".join(proc.stderr.split())
    proc = sftctl("run", str(path), "--set", "train.steps")
    assert proc.returncode == 2 and no_traceback(proc)
    proc = sftctl("run", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "no such file" in proc.stderr and no_traceback(proc)


# ------------------------------------------------------------------ property tests: never a traceback

FIELDS = ["name", "workdir", "model", "train", "resources", "env", "setup", "run", "recovery",
          "framework", "entrypoint", "batch_size", "dtype", "steps", "checkpoint_interval",
          "accelerators", "nodes", "spot", "clouds", "regions", "max_price_per_hour", "deadline",
          "max_restarts", "count"]
keys = st.one_of(st.sampled_from(FIELDS), st.text(min_size=1, max_size=8))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20),
    st.sampled_from(["${HOME}", "${UNSET_VAR_X}", "$${x}", "cpu:2", "H100:8", "6h", "torch", "a.py:f"]),
)
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.dictionaries(keys, documents, max_size=8))
def test_random_documents_never_crash(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        load_spec(path, environ={"HOME": "/h"})
    except SftctlError as e:  # one line per problem (issue 37.9: every problem at once), each at its place
        assert e.message and all(line.startswith((str(path), "--set ", "... and ")) for line in e.message.splitlines())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=string.printable, max_size=200))
def test_random_text_never_crashes(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(text)
    try:
        load_spec(path, environ={})
    except SftctlError as e:  # one line per problem (issue 37.9: every problem at once), each at its place
        assert e.message and all(line.startswith((str(path), "--set ", "... and ")) for line in e.message.splitlines())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.sampled_from(["train.steps", "resources.nodes", "resources.accelerators.0",
                                    "model.batch_size", "env.X", "run", "name", "train", "a..b", ""]),
                  st.text(max_size=15)),
    value=st.one_of(st.text(max_size=20), st.sampled_from(["[1, 2]", "{a: 1}", "null", "-1", "1e9", "true", "[", "{"])),
)
def test_random_overrides_never_crash(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text("name: demo\nrun: echo\nresources:\n  accelerators: [cpu]\n")
    try:
        load_spec(path, [f"{key}={value}"], environ={})
    except SftctlError as e:  # one line per problem (issue 37.9: every problem at once), each at its place
        assert e.message and all(line.startswith((str(path), "--set ", "... and ")) for line in e.message.splitlines())


@pytest.mark.parametrize("override", ["²=1", "resources.accelerators.²=cpu", "resources.accelerators=[cpu:²]"])
def test_unicode_digits_are_not_indices(tmp_path, override):
    """Found by hypothesis in CI: '²'.isdigit() is True but int('²') raises."""
    msg = err(tmp_path, "name: demo\nrun: echo\nresources:\n  accelerators: [cpu]\n", [override])
    assert msg.startswith(f"--set {override}")


@pytest.mark.parametrize("field, value", [("health: {interval_s: .inf}", "inf"), ("health: {hang_timeout_s: .nan}", "nan"),
                                          ("resources: {max_price_per_hour: .inf}", "inf"),
                                          ("health: {straggler_ratio: -.inf}", "-inf")])
def test_non_finite_numbers_are_refused(tmp_path, field, value):
    """Issue 14.13: `.inf` passed validation and crashed the node agent."""
    path = tmp_path / "job.yaml"
    path.write_text(f"name: x\nrun: echo\n{field}\n")
    with pytest.raises(SpecError, match=r"job.yaml:3: .*finite number"):
        load_spec(path)


def test_the_agent_refuses_a_non_finite_interval():
    import argparse

    from sftctl.agent import _positive

    assert _positive("0.5") == 0.5
    for bad in ("inf", "nan", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _positive(bad)


@pytest.mark.parametrize("stem, name", [("2024-exp", "job-2024-exp"), ("My Exp_v2", "my-exp-v2"),
                                        ("_x", "x"), ("9", "job-9"), ("a" * 60, "a" * 40)])
def test_default_name_from_any_file_name_is_valid(tmp_path, stem, name):
    """Issue 14.24: `2024-exp.yaml` without name: blamed a name: field on line 1."""
    path = tmp_path / f"{stem}.yaml"
    path.write_text("run: echo\n")
    assert load_spec(path).name == name


@pytest.mark.parametrize("given, fix", [("训练-ünï", "uni"), ("My Job", "my-job"), ("训练", "job"),
                                        ("2024 run", "job-2024-run"), ("a" * 50, "a" * 40)])
def test_a_bad_name_says_the_rule_in_words_with_a_fix(tmp_path, given, fix):
    """A user saw "String should match pattern '^[a-z][a-z0-9.-]{0,39}$'" for `name: 训练-ünï`."""
    msg = err(tmp_path, yaml.safe_dump({"name": given, "run": "echo"}, allow_unicode=True))
    assert msg == (f"job.yaml:1: name: a job name is lowercase letters, digits, '.' and '-', starting with a letter, "
                   f"at most 40 characters (got {given!r})")
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path / "job.yaml", f"name: {given!r}\nrun: echo\n"), environ={})
    assert e.value.hint == f"e.g. name: {fix}"
    assert load_spec(write_spec(tmp_path / "fixed.yaml", f"name: {fix}\nrun: echo\n"), environ={}).name == fix
    assert "should match pattern" not in err(tmp_path, "name: demo\nrun: echo\n", overrides=[f"name={fix.upper()}"])


def test_env_values_reach_the_node_as_written(tmp_path):
    """YAML 1.1 read `010` as 8, `1:30` as 90 and `0022` as 18; env values are the text written."""
    path = write_spec(
        tmp_path / "job.yaml",
        "name: demo\nrun: echo\nenv:\n  UMASK: 0022\n  A: 010\n  T: 1:30\n  F: 1.50\n  B: true\n  H: 0x1F\n"
        "  Q: '007'\n  N: 1_000\n",
    )
    spec = load_spec(path, ["env.S=0o17", "env.Z=00"], environ={})
    assert spec.env == {"UMASK": "0022", "A": "010", "T": "1:30", "F": "1.50", "B": "true", "H": "0x1F",
                        "Q": "007", "N": "1_000", "S": "0o17", "Z": "00"}
    spec = load_spec(path, ["env={UMASK: 0022, W: 2:05}"], environ={})
    assert spec.env == {"UMASK": "0022", "W": "2:05"}


@pytest.mark.parametrize(
    "text, expected",
    [("010", 10), ("0o22", 18), ("0x10", 16), ("+7", 7), ("1:30", "1:30"), ("1_000", "1_000"), ("0b11", "0b11")],
)
def test_numbers_elsewhere_follow_yaml_1_2(tmp_path, text, expected):
    from sftctl.spec import _compose, _Located

    assert _compose(f"x: {text}\n", _Located("t.yaml")) == {"x": expected}
    path = write_spec(tmp_path / "job.yaml", "name: demo\nrun: echo\n")
    if isinstance(expected, int):
        assert load_spec(path, [f"train.steps={text}"], environ={}).train.steps == expected
        assert load_spec(write_spec(tmp_path / "j2.yaml", f"name: demo\nrun: echo\ntrain: {{steps: {text}}}\n"),
                         environ={}).train.steps == expected
    else:
        assert "train.steps" in err(tmp_path, "name: demo\nrun: echo\n", [f"train.steps={text}"])


def test_an_env_value_longer_than_linux_allows_is_refused_naming_it(tmp_path):
    """One NAME=value over 128 KiB makes the node's exec fail (E2BIG): said at load, naming it."""
    from sftctl.spec import ENV_ENTRY_MAX_BYTES

    fits = "x" * (ENV_ENTRY_MAX_BYTES - len("BIG="))
    path = write_spec(tmp_path / "job.yaml", "name: demo\nrun: echo\n")
    assert load_spec(path, [f"env.BIG={fits}"], environ={}).env["BIG"] == fits
    message = err(tmp_path, "name: demo\nrun: echo\n", [f"env.BIG={fits}y"])
    assert "BIG: 131,068 bytes is more than one environment variable holds" in message and "file" in message


def test_env_references_are_checked_after_set(tmp_path):
    """A `${VAR}` given by --set env.X is checked like the file's: unset, one line naming it."""
    msg = err(tmp_path, "name: demo\nrun: echo\n", ["env.T=${SFTCTL_T_NOPE}"])
    assert msg == "--set env.T=${SFTCTL_T_NOPE}: env.T: ${SFTCTL_T_NOPE} is not set in the environment"
    with pytest.raises(SpecError, match=r"env.T: \$\{B\} is not set in the environment of the controller"):
        resolve_env({"T": "${B}"}, {})


@pytest.mark.parametrize("field,text,limit", [
    ("train.steps", "train:\n  steps: 99999999999999999999999999\n", 10**12),
    ("train.checkpoint_interval", "train:\n  checkpoint_interval: 1000000000001\n", 10**12),
    ("model.batch_size", "model:\n  entrypoint: examples/gpt/model.py:build\n  batch_size: 1000000001\n", 10**9),
    ("resources.nodes", "resources:\n  nodes: 10001\n", 10**4),
    ("resources.accelerators[0].count", "resources:\n  accelerators: [H100:100000]\n", 1024),
    ("recovery.max_restarts", "recovery:\n  max_restarts: 1000001\n", 10**6),
])
def test_counts_have_upper_bounds_named_at_their_line(tmp_path, field, text, limit):
    """Item 3: `steps: 99999999999999999999999999` was accepted (plan: 5815341594913154269184.0 h)."""
    msg = err(tmp_path, f"name: demo\nworkdir: {REPO}\n{text}run: echo\n")
    line = 2 + text.count("\n")  # the field is the text's last line, after name and workdir
    assert msg.startswith(f"job.yaml:{line}: {field}: Input should be less than or equal to {limit} (got "), msg
    at_limit = text.replace(text.split(": ")[-1].strip().strip("[]").split(":")[-1], str(limit))
    assert load_spec(write_spec(tmp_path / "ok.yaml", f"name: demo\nworkdir: {REPO}\n{at_limit}run: echo\n"))


def test_every_problem_of_a_spec_at_once_each_at_its_line(tmp_path):
    """Issue 37.9: a spec with several problems says all of them, each with its line, not the
    first and "(and 2 more problems)"; a top-level ``steps:`` points at ``train.steps``."""
    spec = write_spec(tmp_path / "bad.yaml", "name: bad\nsteps: 3\nresources:\n  nodes: x\n  acelerators: [cpu:1]\nrun: echo\n")
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    lines = e.value.message.splitlines()
    assert lines == [f"{spec}:2: steps: unknown field; did you mean 'train.steps'?",
                     f"{spec}:4: resources.nodes: Input should be a valid integer (got 'x')",
                     f"{spec}:5: resources.acelerators: unknown field; did you mean 'accelerators'?"], lines
    many = write_spec(tmp_path / "many.yaml", "name: m\nrun: echo\n" + "".join(f"x{i}: 1\n" for i in range(40)))
    with pytest.raises(SpecError) as e:
        load_spec(many)
    lines = e.value.message.splitlines()
    assert len(lines) == 20 and lines[-1] == "... and 21 more problems", lines
    assert lines[0] == f"{many}:3: x0: unknown field"


def test_a_local_request_larger_than_the_machine_names_its_size(tmp_path, home):
    import os

    cores = os.cpu_count()
    spec = write_spec(tmp_path / "big.yaml", f"name: big\nresources: {{accelerators: ['cpu:{cores + 1}'], clouds: [local]}}\nrun: echo\n")
    proc = sftctl("plan", str(spec))
    assert proc.returncode == 3 and no_traceback(proc), proc.stderr
    assert f"cpu:{cores + 1} is more than this machine has: {cores} CPU cores, " in proc.stderr, proc.stderr
    assert " GiB memory" in proc.stderr and "no provider offers it" not in proc.stderr, proc.stderr


def test_api_overrides_are_named_as_the_caller_wrote_them(home):
    """api.dry_run(..., overrides={"train.steps": "x"}) said `--set train.steps=x: ...`: CLI words."""
    from sftctl import api

    quickstart = str(REPO / "examples" / "quickstart.yaml")
    with pytest.raises(SpecError) as e:
        api.dry_run(quickstart, overrides={"train.steps": "x"})
    assert e.value.message == "overrides[\"train.steps\"]: train.steps: Input should be a valid integer (got 'x')"
    assert str(e.value).startswith('overrides["train.steps"]')
    with pytest.raises(SpecError) as e:
        api.load(quickstart, overrides={"train.steps": 5, "a..b": 1})
    assert e.value.message == "overrides[\"a..b\"]: empty segment in 'a..b'"
    with pytest.raises(SpecError) as e:  # what the CLI passes: its --set options, named as typed
        api.load(quickstart, overrides=["train.steps=x"])
    assert e.value.message.startswith("--set train.steps=x: train.steps:")


def test_a_relative_set_storage_through_a_server_is_the_users_directory(tmp_path, home, monkeypatch):
    """`sftctl run --set storage=relstore` through a server took relstore from the server's current
    directory: the job's checkpoints went below the server's. The client makes it absolute
    against its own directory, as a run without a server does; storage given otherwise (a URL,
    an absolute path, other keys) goes as written."""
    pytest.importorskip("fastapi")
    from sftctl import api
    from sftctl.spec import absolute_storage_overrides
    from test_server import Server, as_user, tokens

    (tmp_path / "shell").mkdir()
    monkeypatch.chdir(tmp_path / "shell")
    shell = tmp_path / "shell"
    assert absolute_storage_overrides(["storage=rel", "storage.url=./o", "storage=s3://b/p", "storage=/abs",
                                       "train.steps=3", "storage.max_workdir_mb=5", "storage={url: x}"]) == \
        [f"storage={shell / 'rel'}", f"storage.url={shell / 'o'}", "storage=s3://b/p", "storage=/abs",
         "train.steps=3", "storage.max_workdir_mb=5", "storage={url: x}"]
    spec = write_spec(tmp_path / "st.yaml", "name: st\nrun: echo hi\n")
    server = Server(home, tmp_path / "server.log").start()
    try:
        as_user(monkeypatch, server, tokens("alice")["alice"])
        sub = api.submit(str(spec), ["storage=relstore"])
        api.down(sub.job_id)
        assert sub.spec.storage.url == str(shell / "relstore")
    finally:
        server.stop()
