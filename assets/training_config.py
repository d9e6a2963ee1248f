"""The run config of ``training_attempt``: the run's identity and policy beside the trainer's
whole :class:`~pipeline.trainer.config.TrainConfig`.

``ops: {training_attempt: {config: {run_id, owner, purpose, retry_policy, note, continue_in_run,
train: {...}}}}``.
``train`` is generated from TrainConfig's dataclass fields (nested sections nested, each field's
docstring its description in the Launchpad), never restated here. Every ``train`` key is optional
and has no Dagster default: left out, a new run takes TrainConfig's default and a continued run
its last attempt's value. ``snapshot_dir`` is not in it (the partition decides it), so Dagster
refuses the key before the run starts.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from pipeline import ids
from pipeline.ledger.notes import InvalidNoteError, note_text
from pipeline.states import Purpose
from pipeline.trainer.config import MODEL_SECTIONS, ConfigError, TrainConfig, field_docs

SOURCE = "run config of training_attempt"
# The partition's snapshot decides it: run config never does.
NOT_IN_RUN_CONFIG = frozenset({"snapshot_dir"})
# What a run is, not how it trains: a continued run keeps them, or its receipt (the partition's
# snapshot, its model family) would name data and a model it did not train.
RUN_IDENTITY_KEYS = ("snapshot_dir", "model_family")

_SCALARS: dict[Any, Any] = {bool: dg.Bool, int: dg.Int, float: dg.Float, str: dg.String}


def dataclass_shape(cls: type, skip: frozenset[str] = frozenset()) -> dg.Shape:
    """A Dagster config shape with every field of the dataclass ``cls`` (but ``skip``) optional,
    nested dataclasses nested, each field's docstring and default as its description."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields: dict[str, dg.Field] = {}
    for spec in dataclasses.fields(cls):
        if spec.name in skip:
            continue
        fields[spec.name] = dg.Field(
            _config_type(hints[spec.name], f"{cls.__name__}.{spec.name}"),
            is_required=False,
            description=_description(docs.get(spec.name, ""), spec),
        )
    return dg.Shape(fields)


def model_sections_shape() -> dg.Shape:
    """The ``model`` section of every family in one shape: each key once, its description
    (each family's, for a key two share) saying which family reads it; TrainConfig refuses a
    key of another family than the run's."""
    merged: dict[str, tuple[Any, list[str]]] = {}
    for family, cls in MODEL_SECTIONS.items():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for spec in dataclasses.fields(cls):
            said = f"{_description(docs.get(spec.name, ''), spec)} ({family})"
            kind = _config_type(hints[spec.name], f"{cls.__name__}.{spec.name}")
            if spec.name in merged:
                merged[spec.name][1].append(said)
            else:
                merged[spec.name] = (kind, [said])
    return dg.Shape(
        {
            name: dg.Field(kind, is_required=False, description=" / ".join(said))
            for name, (kind, said) in merged.items()
        }
    )


def _config_type(annotation: Any, where: str) -> Any:
    if dataclasses.is_dataclass(annotation):
        return dataclass_shape(typing.cast(type, annotation))
    args = typing.get_args(annotation)
    if set(args) == set(MODEL_SECTIONS.values()):
        return model_sections_shape()
    if typing.get_origin(annotation) in (types.UnionType, typing.Union) and type(None) in args:
        [inner] = [a for a in args if a is not type(None)]
        return dg.Noneable(_config_type(inner, where))
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    raise TypeError(f"{where}: no Dagster config type for {annotation!r}")


def _description(doc: str, spec: dataclasses.Field[Any]) -> str:
    if spec.default is dataclasses.MISSING:
        return doc  # a section: its fields say their own defaults
    return f"{doc} Default: {json.dumps(spec.default)}."


TRAINING_ATTEMPT_CONFIG: dict[str, dg.Field] = {
    "run_id": dg.Field(
        dg.Noneable(dg.String),
        is_required=False,
        description="Continue this existing run (a resume or retry): its last attempt's config, "
        "with what `train` sets changed. Left out: a new run.",
    ),
    "owner": dg.Field(dg.String, default_value="tracks", description="Who the run is for."),
    "purpose": dg.Field(
        dg.String,
        default_value="baseline",
        description=f"Why it runs: one of {', '.join(p.value for p in Purpose)}.",
    ),
    "retry_policy": dg.Field(
        dg.Noneable(dg.String),
        is_required=False,
        description="Inline YAML with the retry policy (files are not read from run config); "
        "else the defaults.",
    ),
    "note": dg.Field(
        dg.Noneable(dg.String),
        is_required=False,
        description="Why this launch (a sentence or two, at most 2000 characters): recorded as "
        "a note on the attempt, by who launched it, and shown by `tracks explain`.",
    ),
    "continue_in_run": dg.Field(
        dg.Bool,
        default_value=True,
        description="When the trainer dies and the retry policy continues the run at once "
        "(a preemption; a backoff of at most a few seconds), open the next attempt in this "
        "Dagster run instead of waiting for the resume sensor to launch a new one. Never after "
        "a person terminates the run. The resume sensor's continuations carry it over.",
    ),
    "train": dg.Field(
        dataclass_shape(TrainConfig, skip=NOT_IN_RUN_CONFIG),
        is_required=False,
        description="The trainer's config (pipeline/trainer/config.py, TrainConfig) but "
        "snapshot_dir, which the partition decides. A key left out takes TrainConfig's "
        "default for a new run, the last attempt's value for a continued one.",
    ),
}


@dataclass(frozen=True)
class TrainingRunConfig:
    """``training_attempt``'s run config as Dagster resolved it; ``train`` holds only the keys
    the run config sets."""

    owner: str
    purpose: str
    run_id: str | None = None
    retry_policy: str | None = None
    train: Mapping[str, Any] = field(default_factory=dict)
    note: str | None = None  # the launch-time note, recorded on the attempt
    continue_in_run: bool = True  # open the next attempt in this Dagster run when due at once


def family_defaults(family: str) -> dict[str, Any]:
    """Where a new run on a snapshot of ``family`` starts, before its run config: TrainConfig's
    defaults are the digits'; another family starts from its named config
    (pipeline/trainer/configs/<family>.yaml), so a text partition materialized from the UI
    with no run config trains the text-lm demo's model, not a digits CNN on text."""
    from pipeline.data.families import DEFAULT_FAMILY
    from pipeline.trainer.config import named_config

    return {} if family == DEFAULT_FAMILY else named_config(family)


def train_config_for_attempt(
    book: Any,
    config: TrainingRunConfig,
    snapshot: Any,
    run_id: str | None,
    *,
    default_device: Callable[[], str | None] = lambda: None,
) -> TrainConfig:
    """The attempt's :class:`TrainConfig`, validated: a new run's from ``config.train`` on the
    partition's snapshot (the device ``default_device()`` names where ``train`` sets none, else
    TrainConfig's); a continued run's (``run_id``) from its last attempt's, with what
    ``config.train`` sets changed.

    Raises :class:`ConfigError` naming the run config key.
    """
    if config.purpose not in {str(p) for p in Purpose}:
        raise ConfigError(
            SOURCE,
            "purpose",
            f"{config.purpose!r} is not one of {', '.join(str(p) for p in Purpose)}",
        )
    if config.note is not None:
        try:
            note_text(config.note)
        except InvalidNoteError as exc:
            raise ConfigError(SOURCE, "note", exc.problem) from None
    train = dict(config.train)
    refused = sorted(NOT_IN_RUN_CONFIG & train.keys())
    if refused:
        raise ConfigError(SOURCE, f"train.{refused[0]}", "is decided by the partition's snapshot")
    run, last = None, None
    if run_id:
        run = book.get_run(ids.run_id(run_id))
        if run.snapshot_id != snapshot.snapshot_id:
            raise ConfigError(
                SOURCE,
                "run_id",
                f"run {run.run_id} trains on snapshot {run.snapshot_id}, "
                f"not on this partition's {snapshot.snapshot_id}",
            )
        last = book.latest_attempt(run.run_id)
    if run is None or last is None:
        base: dict[str, Any] = {
            **family_defaults(snapshot.family),
            "snapshot_dir": str(snapshot.path),
        }
        device = None if "device" in train else default_device()
        if device:
            base["device"] = device
    else:
        base = dict(last.config_snapshot)
        for key in RUN_IDENTITY_KEYS:
            if key in train and train[key] != base.get(key):
                raise ConfigError(
                    SOURCE,
                    f"train.{key}",
                    f"run {run.run_id} keeps its {key}; start a new run to change it",
                )
    for key, value in train.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    try:
        return TrainConfig.from_dict(base, source=SOURCE)
    except ConfigError as exc:
        raise ConfigError(SOURCE, f"train.{exc.key}" if exc.key else "train", exc.problem) from exc
