"""Offline validation of rendered manifests: one clear error naming kind, name and field path.

- Core kinds (``Service``, ``Job``, …): ``kubernetes_validate.validate(obj, "1.33", strict=True)``,
  the upstream OpenAPI schemas with unknown fields refused.
- ``TrainJob`` and ``JobSet``: JSON Schema subsets written for Tracks
  (``pipeline/kube/schemas``); a JobSet's embedded Job templates are then checked as batch/v1
  Jobs by kubernetes-validate, so the pod spec inside gets the same strict check as a plain Job.

Neither evaluates CEL rules or admission webhooks: a manifest that passes here can still be
refused by a cluster (see ``docs/kubernetes.md``, "only checkable on a real cluster").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import kubernetes_validate

KUBERNETES_VERSION = "1.33"

_CRD_SCHEMAS = {
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob.v1alpha1.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.v1alpha2.json",
}


class ManifestValidationError(ValueError):
    """A rendered object a Kubernetes API server would refuse; says which and where."""

    def __init__(self, kind: str, name: str, path: str, message: str) -> None:
        self.kind = kind
        self.name = name
        self.path = path
        self.detail = message
        super().__init__(f"{kind} {name!r}: {path or '<root>'}: {message}")


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: jsonschema.ValidationError) -> str:
    # Schema dumps are long and say nothing the path and message don't; keep the one line.
    return error.message if len(error.message) <= 300 else error.message[:300] + "…"


@cache
def _crd_validator(filename: str) -> jsonschema.Draft202012Validator:
    text = resources.files("pipeline.kube").joinpath("schemas", filename).read_text("utf-8")
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _identity(obj: Mapping[str, Any]) -> tuple[str, str]:
    kind = obj.get("kind") if isinstance(obj.get("kind"), str) else "<no kind>"
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return str(kind), name if isinstance(name, str) else "<no name>"


def _validate_core(obj: Mapping[str, Any], kind: str, name: str, prefix: tuple = ()) -> None:
    try:
        kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        raise ManifestValidationError(
            kind, name, _path((*prefix, *error.absolute_path)), _message(error)
        ) from None
    except kubernetes_validate.SchemaNotFoundError as error:
        raise ManifestValidationError(kind, name, "apiVersion", error.message) from None


def validate_manifest(obj: Mapping[str, Any]) -> None:
    """Raise :class:`ManifestValidationError` if ``obj`` is not a valid object of its kind."""
    if not isinstance(obj, Mapping):
        raise ManifestValidationError("<no kind>", "<no name>", "", "a manifest is a mapping")
    kind, name = _identity(obj)
    for key in ("apiVersion", "kind"):
        if not isinstance(obj.get(key), str):
            raise ManifestValidationError(kind, name, key, f"'{key}' is a required string")
    schema_file = _CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema_file is None:
        _validate_core(obj, kind, name)
        return
    validator = _crd_validator(schema_file)
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        raise ManifestValidationError(kind, name, _path(error.absolute_path), _message(error))
    if obj["kind"] == "JobSet":
        for i, replicated in enumerate(obj["spec"]["replicatedJobs"]):
            template = replicated["template"]
            job = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {
                    "name": f"{name}-{replicated['name']}-0",
                    **template.get("metadata", {}),
                },
                "spec": template["spec"],
            }
            _validate_core(job, kind, name, ("spec", "replicatedJobs", i, "template"))


def validate_all(objs: Iterable[Mapping[str, Any]]) -> None:
    """:func:`validate_manifest` each object, stopping at the first invalid one."""
    for obj in objs:
        validate_manifest(obj)
