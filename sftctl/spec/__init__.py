"""The job spec: pydantic v2 models and a YAML loader whose errors name the field and its line.

A job spec is a YAML file (see ``examples/quickstart.yaml``)::

    name: quickstart
    workdir: ..                       # relative to this file
    model: {framework: torch, entrypoint: examples/gpt/model.py:build, batch_size: 32}
    train: {steps: 300, checkpoint_interval: 100}
    resources: {accelerators: ["cpu:1"], nodes: 2}
    run: torchrun ... examples/gpt/train.py

Rules the loader enforces, so a typo is never silently accepted:

* unknown keys are errors, with a did-you-mean hint; duplicate keys are errors;
* ``${VAR}`` and ``${VAR:-default}`` are replaced from the environment in every string except
  ``setup`` and ``run`` (those are shell scripts; the node's shell expands them); ``$${`` is a
  literal ``${``; an unset variable without a default is an error naming its field and line;
* ``--set key.path=value`` overrides (value parsed as a YAML scalar) are validated like the file,
  and errors name the override instead of a line.

Every problem raises :class:`sftctl.errors.SpecError` (exit code 2) with one line of the form
``job.yaml:12: resources.acelerators: unknown field; did you mean 'accelerators'?``; a spec
with several problems gets one line each, in line order, up to a screen (MAX_PROBLEM_LINES).

The package's modules (every name is re-exported here; import from ``sftctl.spec``):
:mod:`~sftctl.spec.model` (the models), :mod:`~sftctl.spec.env` (``${VAR}`` and ``env:``),
:mod:`~sftctl.spec.load` (the loader, overrides, error lines).
"""

from __future__ import annotations

from sftctl.spec.model import (  # noqa: F401 (re-exported)
    CLOUDS, ENV_ENTRY_MAX_BYTES, HEALTH_THRESHOLDS, MAX_BATCH, MAX_COUNT, MAX_NODES, MAX_PER_NODE,
    MAX_SPEC_BYTES, MAX_STEPS, _NO_INTERPOLATION, Accelerator, ControllerSpec, HealthSpec, JobSpec, ModelSpec,
    RecoverySpec, ResourcesSpec, SlurmSpec, SpotPolicy, StorageSpec, StrictNonNegativeInt, StrictPositiveInt,
    TrainSpec, _HealthHead, _HealthThresholds, _Strict, _accelerator_mapping, _parse_accelerator,
    _threshold_field,
)
from sftctl.spec.env import (  # noqa: F401 (re-exported)
    _SHELL_REF, _SHELL_SET, _SINGLE_QUOTED, _VAR, _check_env_references, _expand, _interpolate, _unset,
    env_references, resolve_env, unset_shell_references,
)
from sftctl.spec.load import (  # noqa: F401 (re-exported)
    MAX_PROBLEM_LINES, _all_problems, _apply_override, _check_entrypoint_function, _explain, _field_model_at,
    _read_spec_file, _unwrap, _user_defaults, absolute_storage_overrides, default_name, load_spec,
    unknown_accelerator,
)
from sftctl.errors import SpecError  # noqa: F401 (importable from here, as before)
from sftctl.health.registry import Threshold as HealthThreshold, spec_thresholds  # noqa: F401
# the YAML 1.2 loader with line numbers lives in sftctl.yaml12 (light: sftctl.settings reads the
# config file with it); these names stay importable from here
from sftctl.yaml12 import (  # noqa: F401
    Path_,
    _build,
    _check_depth,
    _compose,
    _dotted,
    _Located,
    _Loader,
    parse_duration_s,
    shown,
)
