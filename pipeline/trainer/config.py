"""``TrainConfig``: the flat, printed, immutable description of one training run (nanoGPT style).

Loaded from YAML with every key checked: an unknown or mistyped key, or a missing
``snapshot_dir``, is a :class:`ConfigError` naming the file and the key; a key left out takes the
default set below, and nowhere else (the Dagster run config is generated from these fields,
:func:`field_docs` giving each one's description). ``to_dict()`` is the resolved config (defaults
filled in, ``snapshot_dir`` absolute) that the ledger stores as the attempt's config snapshot and
every checkpoint carries; ``sha256()`` is its digest.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Self

from pipeline import ids
from pipeline.digests import sha256_json
from pipeline.trainer.families import family

OPTIMIZERS = ("adam", "sgd")
LR_SCHEDULES = ("constant", "cosine", "step")
BEST_MODES = ("min", "max")
DEVICES = ("cpu", "cuda")


class ConfigError(ValueError):
    """A training config that does not load; names the file and the key."""

    def __init__(self, source: str, key: str | None, problem: str) -> None:
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class ModelConfig:
    """The ``model`` section of a digits-cnn run (:func:`pipeline.trainer.model.build_model`)."""

    channels: int = 16
    """Channels of the first convolution (the second has twice as many)."""
    hidden: int = 64
    """Width of the hidden fully connected layer."""
    dropout: float = 0.0
    """Dropout before the last layer, in [0, 1)."""

    def check(self, source: str) -> None:
        """Raise :class:`ConfigError` naming the first ``model.*`` key that is wrong."""
        for key in ("channels", "hidden"):
            if getattr(self, key) < 1:
                raise ConfigError(source, f"model.{key}", f"must be >= 1, got {getattr(self, key)}")
        _check_dropout(self.dropout, source)


# docs/text-lm.md: this shape, batch 32 and Adam at 3e-3 learn ~2.6 bits per byte in about
# 600 steps, two minutes of one CPU core.
@dataclass(frozen=True)
class TextModelConfig:
    """The ``model`` section of a text-lm run (:class:`pipeline.textlm.model.TextLMConfig`; its
    vocabulary is the byte tokenizer's, not configurable)."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; n_embd must be a multiple of it."""
    n_embd: int = 128
    """Width of the token embeddings and of every block."""
    block_size: int = 64
    """The longest context, in bytes: a training example is a window of block_size + 1 tokens."""
    dropout: float = 0.0
    """Dropout after attention and the MLP, in [0, 1)."""

    def check(self, source: str) -> None:
        """Raise :class:`ConfigError` naming the first ``model.*`` key that is wrong."""
        for key in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, key) < 1:
                raise ConfigError(source, f"model.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                source,
                "model.n_embd",
                f"must be a multiple of model.n_head ({self.n_head}), got {self.n_embd}",
            )
        _check_dropout(self.dropout, source)


def _check_dropout(value: float, source: str) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(source, "model.dropout", f"must be in [0, 1), got {value}")


# Each model family's ``model`` section: its keys are the family's own, and TrainConfig's
# model_family decides which one a config's section is read as.
MODEL_SECTIONS: dict[str, type[ModelConfig] | type[TextModelConfig]] = {
    "digits-cnn": ModelConfig,
    "text-lm": TextModelConfig,
}


@dataclass(frozen=True)
class LRScheduleConfig:
    """``constant``; ``cosine`` from learning_rate to ``min_lr`` over max_steps; or ``step``;
    each after ``warmup_steps`` of linear warm-up."""

    kind: str = "constant"
    """One of constant, cosine, step."""
    min_lr: float = 0.0
    """cosine: the learning rate reached at max_steps (0..learning_rate)."""
    step_size: int = 100
    """step: steps between two decays."""
    gamma: float = 0.5
    """step: the factor each decay multiplies the learning rate by, in (0, 1]."""
    # A transformer trained at full rate from its first step learns markedly less in the same
    # steps (text-lm demo, step 200: 3.42 bits per byte with 50 warm-up steps, 3.93 without).
    warmup_steps: int = 0
    """Steps over which the rate climbs linearly to the schedule's (step s: s/warmup_steps of
    it); 0: none."""


SPIKE_ACTIONS = ("skip", "rollback", "stop")
SPIKE_METRICS = ("loss", "grad_norm")


@dataclass(frozen=True)
class SpikeConfig:
    """The ``spikes`` section: the loss-spike detector (pipeline/trainer/spikes.py) and what a
    spike does. Part of the trajectory: a skipped update or a rollback changes the weights."""

    enabled: bool = True
    """Judge every step's loss and gradient norm; false: no detector (nothing skipped, nothing
    recorded)."""
    action: str = "skip"
    """What a spike does: skip (no optimizer update on that step; the step and the data move
    on), rollback (restore the newest committed checkpoint from before the spike, then deal
    the data past the batches that caused it) or stop (end the attempt as diverged)."""
    metrics: str = "loss,grad_norm"
    """Comma-separated: which of loss and grad_norm (the global L2 norm of the gradients,
    before the update) are judged; a spike in either is a spike."""
    window: int = 128
    """Steps of recent history (spikes left out) the mean and standard deviation are taken
    over."""
    # 20 clean demo runs (seeds 0-19): the gradient norm climbs ~20x over the first 40 steps,
    # a z-score of 7 against a window still that young; judged from step 51 on, the highest of
    # any seed was 4.5 (bench/results/2026-11-27-health-false-positives.md).
    min_history: int = 50
    """Steps in the window before the detector judges at all (the gradient norm climbs for
    the first tens of steps); a non-finite value is a spike from the first step."""
    zscore: float | None = 6.0
    """A value more than this many standard deviations above the window's mean is a spike;
    null: not judged by z-score."""
    ratio: float | None = None
    """A value more than this many times the window's mean is a spike; null: not judged by
    ratio."""
    max_spikes: int | None = 10
    """The run's spike count (over all attempts) at which it stops as diverged, whatever the
    action; null: never for their number."""
    skip_batches_before: int = 2
    """rollback: batches before the spiking one that are never dealt again."""
    skip_batches_after: int = 2
    """rollback: batches after the spiking one that are never dealt."""

    @property
    def metric_names(self) -> tuple[str, ...]:
        """``metrics`` as names, in the order written."""
        return tuple(name.strip() for name in self.metrics.split(",") if name.strip())

    def check(self, source: str) -> None:
        """Raise :class:`ConfigError` naming the first ``spikes.*`` key that is wrong."""

        def bad(key: str, problem: str) -> ConfigError:
            return ConfigError(source, f"spikes.{key}", problem)

        if self.action not in SPIKE_ACTIONS:
            raise bad("action", f"must be one of {', '.join(SPIKE_ACTIONS)}, got {self.action!r}")
        names = self.metric_names
        unknown = [name for name in names if name not in SPIKE_METRICS]
        if not names or unknown or len(set(names)) != len(names):
            raise bad(
                "metrics",
                f"must name {' and/or '.join(SPIKE_METRICS)}, comma-separated, "
                f"each once, got {self.metrics!r}",
            )
        if self.window < 2:
            raise bad("window", f"must be >= 2, got {self.window}")
        if not 2 <= self.min_history <= self.window:
            raise bad(
                "min_history", f"must be in 2..window ({self.window}), got {self.min_history}"
            )
        for key, value in (("zscore", self.zscore), ("ratio", self.ratio)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise bad(key, f"must be a finite number > 0 or null, got {value}")
        if self.ratio is not None and self.ratio <= 1:
            raise bad("ratio", f"must be > 1 (a multiple of the mean), got {self.ratio}")
        if self.enabled and self.zscore is None and self.ratio is None:
            raise bad("zscore", "is null and so is spikes.ratio: nothing would be a spike")
        if self.max_spikes is not None and self.max_spikes < 1:
            raise bad("max_spikes", f"must be >= 1 or null, got {self.max_spikes}")
        for key in ("skip_batches_before", "skip_batches_after"):
            if getattr(self, key) < 0:
                raise bad(key, f"must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class WatchdogConfig:
    """The ``watchdog`` section: the hang watchdog every rank runs (pipeline/trainer/watchdog.py).

    Operational: it never changes a weight, so it stays out of the config digest. A rank is hung
    when no step finishes for max(``multiple`` x its p99 step time, ``floor_seconds``); checkpoint
    saves, ledger heartbeats and a drill's deliberate pause do not count against it.
    """

    enabled: bool = True
    """Watch each rank, from its first finished step, for a step that never finishes; false: no
    watchdog (a stuck rank then waits until something outside stops it)."""
    multiple: float = 5.0
    """Times this attempt's p99 step time (of the steps so far) without a finished step that
    make a rank hung; never below floor_seconds."""
    # Below the resume sensor's heartbeat timeout (TRACKS_HEARTBEAT_TIMEOUT, 60 s): a stuck trainer
    # stops heartbeating too, and the watchdog must end it as hung, with its stacks, before the
    # silence sweep takes it for a lost node. A stall longer than that already ended the attempt.
    floor_seconds: float = 45.0
    """The least time without a finished step that counts as a hang, in seconds; keep it below
    the resume sensor's heartbeat timeout (60 s), or a hang is closed as a lost trainer first."""

    def check(self, source: str) -> None:
        """Raise :class:`ConfigError` naming the first ``watchdog.*`` key that is wrong."""
        limits = {"multiple": (self.multiple, 1.0), "floor_seconds": (self.floor_seconds, 0.1)}
        for key, (value, least) in limits.items():
            if not (math.isfinite(value) and value >= least):
                raise ConfigError(
                    source, f"watchdog.{key}", f"must be a finite number >= {least}, got {value}"
                )


# Keys added to a section after checkpoints existed, with the behaviour every config had before
# them: left out of the digest at that value (TrainConfig.trajectory_dict).
ADDED_KEYS: dict[tuple[str, str], Any] = {("lr_schedule", "warmup_steps"): 0}

# Settings that change how a run is operated, never what it computes (resume is bit-exact
# whatever they are): left out of the config digest.
OPERATIONAL_KEYS = frozenset(
    {
        "watchdog",
        "async_save",
        "log_every_steps",
        "checkpoint_every_steps",
        "keep_last_k",
        "keep_best_k",
        "best_metric",
        "best_mode",
        "max_wall_seconds",
    }
)


@dataclass(frozen=True)
class TrainConfig:
    """One run's training config; build with :meth:`load` (YAML) or :meth:`from_dict`.

    The one schema of training: the trainer's YAML, the Dagster run config's ``train`` section
    (generated from these fields, their docstrings its descriptions) and the ledger's config
    snapshot. Every field but ``snapshot_dir`` has its default here and nowhere else.
    """

    snapshot_dir: str
    """The data snapshot's folder; in Dagster the partition decides it."""
    seed: int = 0
    """Seeds Python, numpy and torch, and the data order: the same seed trains the same model."""
    # 300 steps reach ~97% held-out accuracy on the digits, well past the promotion gate.
    max_steps: int = 300
    """Optimizer steps of the whole run (a resumed attempt goes on to the same step)."""
    checkpoint_every_steps: int = 100
    """Steps between two periodic checkpoints; the last step is always checkpointed."""
    batch_size: int = 64
    """Examples per optimizer step, over all ranks (divisible by their number)."""
    learning_rate: float = 0.003
    """The optimizer's (initial) learning rate, > 0."""
    optimizer: str = "adam"
    """adam or sgd."""
    model: ModelConfig | TextModelConfig = field(default_factory=ModelConfig)
    """The model's shape; its keys are the model family's own (digits-cnn: channels, hidden,
    dropout; text-lm: n_layer, n_head, n_embd, block_size, dropout)."""
    weight_decay: float = 0.0
    """Weight decay, >= 0."""
    momentum: float = 0.9
    """sgd only: momentum, in [0, 1)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """How the learning rate changes over the run."""
    keep_last_k: int = 3
    """Newest committed checkpoints kept; older ones are deleted (the best ones excepted)."""
    keep_best_k: int = 1
    """Committed checkpoints kept for being the best by best_metric; 0 keeps none for that."""
    best_metric: str = "eval_loss"
    """The metric (train_loss, eval_loss, eval_accuracy; text-lm also eval_bits_per_byte) that
    ranks checkpoints for keep_best_k."""
    best_mode: str = "min"
    """min or max: whether a lower or a higher best_metric is better."""
    model_family: str = "digits-cnn"
    """The model family the run trains (digits-cnn or text-lm), part of its run id; the
    snapshot must hold its data; a continued run keeps it."""
    max_wall_seconds: float | None = None
    """Stop with a final checkpoint after this many seconds (the attempt ends timed out);
    null: no limit."""
    log_every_steps: int = 10
    """Steps between two logged (and MLflow) training metrics."""
    probe_size: int = 16
    """Held-out examples whose outputs each checkpoint records, to prove a restore exact."""
    device: str = "cpu"
    """cpu or cuda. Left out of a new run's Dagster run config, it follows the trainer's
    placement: cuda when the run is given GPUs."""
    # Periodic checkpoints are written by a background thread after a synchronous staging
    # copy; the final and the preemption checkpoint are always synchronous.
    async_save: bool = True
    """Write periodic checkpoints in the background; the final one is always synchronous."""
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    """The loss-spike detector and its action (skip, rollback or stop)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """The hang watchdog: when a rank that finishes no step is ended as hung."""

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a YAML file; relative ``snapshot_dir`` paths resolve against its folder."""
        from pipeline import yamlio

        path = Path(path)
        source = str(path)
        try:
            raw = yamlio.load_file(path)  # a duplicate key is an error, never a silent win
        except yamlio.YamlError as exc:
            raise ConfigError(source, None, str(exc).removeprefix(f"{source}: ")) from exc
        return cls.from_dict(raw, source=source, base_dir=path.resolve().parent)

    @classmethod
    def from_dict(
        cls, raw: Any, *, source: str = "<config>", base_dir: str | Path | None = None
    ) -> Self:
        if not isinstance(raw, dict):
            raise ConfigError(source, None, f"must be a mapping, got {type(raw).__name__}")
        values = _check_section(
            raw, cls, source, prefix="", skip={"model", "lr_schedule", "spikes", "watchdog"}
        )
        values["model"] = _model_section(raw, values.get("model_family"), source)
        schedule_raw = raw.get("lr_schedule", {})
        values["lr_schedule"] = LRScheduleConfig(
            **_check_section(schedule_raw, LRScheduleConfig, source, "lr_schedule.")
        )
        values["spikes"] = SpikeConfig(
            **_check_section(raw.get("spikes", {}), SpikeConfig, source, "spikes.")
        )
        values["watchdog"] = WatchdogConfig(
            **_check_section(raw.get("watchdog", {}), WatchdogConfig, source, "watchdog.")
        )
        snapshot_dir = Path(values["snapshot_dir"]).expanduser()
        if not snapshot_dir.is_absolute() and base_dir is not None:
            snapshot_dir = Path(base_dir) / snapshot_dir
        values["snapshot_dir"] = str(snapshot_dir.resolve())
        config = cls(**values)
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
        def bad(key: str, problem: str) -> ConfigError:
            return ConfigError(source, key, problem)

        for key in ("max_steps", "checkpoint_every_steps", "batch_size", "keep_last_k",
                    "log_every_steps", "probe_size"):  # fmt: skip
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.keep_best_k < 0:
            raise bad("keep_best_k", f"must be >= 0, got {self.keep_best_k}")
        # numpy and torch take seeds in [0, 2**32): anything else fails deep in set-up.
        if not 0 <= self.seed < 2**32:
            raise bad("seed", f"must be an integer in 0..{2**32 - 1}, got {self.seed}")
        for key, value in (
            ("learning_rate", self.learning_rate),
            ("weight_decay", self.weight_decay),
            ("momentum", self.momentum),
            ("lr_schedule.min_lr", self.lr_schedule.min_lr),
            ("lr_schedule.gamma", self.lr_schedule.gamma),
            ("max_wall_seconds", self.max_wall_seconds),
        ):
            if value is not None and not math.isfinite(value):
                raise bad(key, f"must be a finite number, got {value}")
        if not self.learning_rate > 0:
            raise bad("learning_rate", f"must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise bad("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            raise bad("momentum", f"must be in [0, 1), got {self.momentum}")
        if not 0 <= self.lr_schedule.min_lr <= self.learning_rate:
            raise bad(
                "lr_schedule.min_lr",
                f"must be in 0..learning_rate ({self.learning_rate}), "
                f"got {self.lr_schedule.min_lr}",
            )
        if not 0 < self.lr_schedule.gamma <= 1:
            raise bad("lr_schedule.gamma", f"must be in (0, 1], got {self.lr_schedule.gamma}")
        ids.model_family(self.model_family)
        if self.optimizer not in OPTIMIZERS:
            raise bad(
                "optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.lr_schedule.kind not in LR_SCHEDULES:
            raise bad(
                "lr_schedule.kind",
                f"must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule.kind!r}",
            )
        if self.lr_schedule.warmup_steps < 0:
            raise bad(
                "lr_schedule.warmup_steps", f"must be >= 0, got {self.lr_schedule.warmup_steps}"
            )
        if self.lr_schedule.step_size < 1:
            raise bad("lr_schedule.step_size", f"must be >= 1, got {self.lr_schedule.step_size}")
        ranked = ("train_loss", *family(self.model_family).metrics)  # what a checkpoint records
        if self.best_metric not in ranked:
            raise bad(
                "best_metric",
                f"{self.best_metric!r} is not a metric a {self.model_family} checkpoint records "
                f"({', '.join(ranked)})",
            )
        if self.best_mode not in BEST_MODES:
            raise bad("best_mode", f"must be min or max, got {self.best_mode!r}")
        if self.device not in DEVICES:
            raise bad("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.max_wall_seconds is not None and self.max_wall_seconds <= 0:
            raise bad("max_wall_seconds", f"must be > 0, got {self.max_wall_seconds}")
        section = MODEL_SECTIONS.get(self.model_family)
        if section is None:
            raise bad("model_family", _unknown_family(self.model_family))
        if type(self.model) is not section:
            raise bad("model", f"is not a {self.model_family} model section")
        self.model.check(source)
        self.spikes.check(source)
        self.watchdog.check(source)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config: every key, defaults filled in, plain JSON values."""
        return asdict(self)

    def trajectory_dict(self) -> dict[str, Any]:
        """The keys that decide the training trajectory: the config minus operational ones,
        and minus keys added later (:data:`ADDED_KEYS`) while they hold the value every config
        had before them, so a checkpoint written before a key existed still resumes."""
        trajectory = {k: v for k, v in self.to_dict().items() if k not in OPERATIONAL_KEYS}
        for (section, key), before in ADDED_KEYS.items():
            if trajectory[section].get(key) == before:
                del trajectory[section][key]
        return trajectory

    def sha256(self) -> str:
        """Digest of :meth:`trajectory_dict`: what a checkpoint must match to be resumed from.

        How often to log or save, how many checkpoints to keep, async saving and the wall-clock
        limit do not change a single weight, so changing them keeps resuming the same run.
        """
        return sha256_json(self.trajectory_dict())


CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
# Named training configs (pipeline/trainer/configs/<name>.yaml): ``train`` sections without a
# snapshot_dir (the run config's partition, or the caller, gives it). The digits demo needs
# none: TrainConfig's defaults are its config.
NAMED_CONFIGS = ("text-lm", "text-lm-tiny")


def named_config(name: str) -> dict[str, Any]:
    """The training config ``name`` (one of :data:`NAMED_CONFIGS`: ``text-lm``, the demo's,
    ``text-lm-tiny``, tens of steps for tests) as a mapping without ``snapshot_dir``."""
    from pipeline import yamlio

    if name not in NAMED_CONFIGS:
        raise ConfigError(
            "named config", None, f"{name!r} is not one of {', '.join(NAMED_CONFIGS)}"
        )
    path = CONFIGS_DIR / f"{name}.yaml"
    raw = yamlio.load_file(path)
    # Checked as the trainer will read it, so a broken file fails here, naming itself.
    TrainConfig.from_dict({**raw, "snapshot_dir": "."}, source=str(path))
    return raw


def _unknown_family(name: str) -> str:
    return f"unknown model family {name!r}; known: {', '.join(MODEL_SECTIONS)}"


def _model_section(
    raw: dict[str, Any], family: str | None, source: str
) -> ModelConfig | TextModelConfig:
    """The ``model`` section read as ``family``'s (TrainConfig's default when None); a key of
    another family's section is named with that family."""
    family = ids.model_family(family or _default_family())  # a bad id is named as one first
    section = MODEL_SECTIONS.get(family)
    if section is None:
        raise ConfigError(source, "model_family", _unknown_family(family))
    model = raw.get("model", {})
    if isinstance(model, dict):
        own = {f.name for f in fields(section)}
        for key in model:
            others = [
                name
                for name, cls in MODEL_SECTIONS.items()
                if name != family and key in {f.name for f in fields(cls)}
            ]
            if key not in own and others:
                raise ConfigError(
                    source,
                    f"model.{key}",
                    f"is a {' and '.join(others)} key, but model_family is {family} "
                    f"(its model keys: {', '.join(sorted(own))})",
                )
    return section(**_check_section(model, section, source, "model."))


def _default_family() -> str:
    [spec] = [f for f in fields(TrainConfig) if f.name == "model_family"]
    return str(spec.default)


def _check_section(
    raw: Any, cls: type, source: str, prefix: str, skip: set[str] | None = None
) -> dict[str, Any]:
    """Type-check one mapping against a dataclass's fields; unknown and missing keys raise."""
    section = prefix.rstrip(".") or None
    if not isinstance(raw, dict):
        raise ConfigError(source, section, f"must be a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(
                source, f"{prefix}{key}", f"is not a known key (known: {', '.join(sorted(known))})"
            )
    values: dict[str, Any] = {}
    for name, spec in known.items():
        if skip and name in skip:
            continue
        key = f"{prefix}{name}"
        if name not in raw:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise ConfigError(source, key, "is required")
            continue
        values[name] = _coerce(raw[name], spec.type, source, key)
    return values


def _coerce(value: Any, annotation: Any, source: str, key: str) -> Any:
    kind = str(annotation)
    optional = "None" in kind
    if value is None:
        if optional:
            return None
        raise ConfigError(source, key, "must not be null")
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"must be true or false, got {value!r}")
        return value
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, f"must be an integer, got {value!r}")
        return value
    if kind.startswith("float"):
        if isinstance(value, str):
            # PyYAML reads ``3e-4`` (no dot) as a string: accept what is plainly a number.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(source, key, f"must be a number, got {value!r}")
        return float(value)
    if kind.startswith("str"):
        if not isinstance(value, str) or not value:
            raise ConfigError(source, key, f"must be a non-empty string, got {value!r}")
        return value
    raise AssertionError(f"unhandled config type {kind} for {key}")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it in ``cls``'s body) on one
    line, by field name.

    Read from the source, as Sphinx and pydantic read attribute docstrings: Python keeps none.
    """
    [node] = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for statement, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[statement.target.id] = " ".join(after.value.value.split())
    return docs
