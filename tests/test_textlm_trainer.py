"""The trainer trains text-lm under the digits' contract: the family table, the config's model
section, SIGKILL at random moments then a bit-exact resume, and two ranks under torchrun with
sharded (DCP) checkpoints, bit-exact against an uninterrupted two-rank run.

The machinery is the digits drills' own (bench/kill_drill.py, tests/distributed_support.py):
nothing in the checkpoint, receipt or resume code knows which family it saves.
"""

from __future__ import annotations

import io
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from bench.kill_drill import ForkServer, Reference, run_reference
from pipeline.checkpoint import checkpoint_dirs, load_checkpoint, verify_checkpoint
from pipeline.checkpoint.restore_check import restore_check
from pipeline.trainer import exit_codes
from pipeline.trainer.config import ConfigError, TrainConfig
from pipeline.trainer.families import UnknownFamilyError, family
from tests.distributed_support import drill_config, launch_ranks, trainer_rank_pids
from tests.trainer_support import TEXT_CONFIG, parse_events, sigkill_then_resume_is_bit_exact

MAX_STEPS = 30
INTERVAL = 2
KEEP_LAST_K = 2
TWO_RANK_STEPS = 40

# (kill moment, seed): "mid_file" and "before_commit" land inside a checkpoint write for sure.
KILL_CASES = [("random", 0), ("random", 1), ("mid_file", 0), ("before_commit", 0)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("textlm-trainer")


@pytest.fixture(scope="module")
def config(workdir: Path) -> Path:
    return drill_config(
        workdir, max_steps=MAX_STEPS, interval=INTERVAL, keep_last_k=KEEP_LAST_K, family="text-lm"
    )


@pytest.fixture(scope="module")
def snapshot_dir(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["snapshot_dir"])


@pytest.fixture(scope="module")
def reference(config: Path, workdir: Path) -> Reference:
    """The uninterrupted run, in a fresh ``python -m pipeline.trainer``."""
    return run_reference(config, workdir / "reference")


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


# -- the family table and the config ---------------------------------------------------------


def test_the_family_table_builds_each_familys_model_and_names_an_unknown_one() -> None:
    text = family("text-lm").build_model(TEXT_CONFIG["model"])
    assert type(text).__name__ == "TextLM" and text.config.block_size == 32
    digits = family("digits-cnn").build_model({"channels": 4, "hidden": 8, "dropout": 0.0})
    assert type(digits).__name__ == "DigitsCNN"
    with pytest.raises(UnknownFamilyError, match=r"'text-gpt'.*digits-cnn, text-lm"):
        family("text-gpt")


def test_a_model_key_of_the_other_family_is_a_config_error_naming_key_and_family(
    tmp_path: Path,
) -> None:
    base = {"snapshot_dir": str(tmp_path)}
    with pytest.raises(ConfigError) as digits_key:
        TrainConfig.from_dict({**base, "model_family": "text-lm", "model": {"channels": 8}})
    assert digits_key.value.key == "model.channels"
    assert "digits-cnn key" in str(digits_key.value) and "model_family is text-lm" in str(
        digits_key.value
    )
    with pytest.raises(ConfigError) as text_key:
        TrainConfig.from_dict({**base, "model": {"n_layer": 2}})  # digits-cnn by default
    assert text_key.value.key == "model.n_layer"
    assert "text-lm key" in str(text_key.value) and "model_family is digits-cnn" in str(
        text_key.value
    )
    with pytest.raises(ConfigError, match=r"model\.n_embd: must be a multiple of model\.n_head"):
        TrainConfig.from_dict(
            {**base, "model_family": "text-lm", "model": {"n_head": 3, "n_embd": 32}}
        )
    with pytest.raises(ConfigError, match="model_family: unknown model family 'text-gpt'"):
        TrainConfig.from_dict({**base, "model_family": "text-gpt"})
    with pytest.raises(ConfigError, match="best_metric: 'eval_bits_per_byte' is not a metric"):
        TrainConfig.from_dict({**base, "best_metric": "eval_bits_per_byte"})  # digits has none
    # The family's own defaults fill its section; the digits section is untouched.
    text = TrainConfig.from_dict({**base, "model_family": "text-lm"})
    assert text.to_dict()["model"] == {
        "n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64, "dropout": 0.0,
    }  # fmt: skip
    digits = TrainConfig.from_dict(base)
    assert digits.to_dict()["model"] == {"channels": 16, "hidden": 64, "dropout": 0.0}


def test_the_run_config_offers_every_familys_model_keys_with_their_descriptions() -> None:
    from assets.training_config import TRAINING_ATTEMPT_CONFIG
    from pipeline.trainer.config import MODEL_SECTIONS, field_docs

    model = TRAINING_ATTEMPT_CONFIG["train"].config_type.fields["model"].config_type.fields
    for name, cls in MODEL_SECTIONS.items():
        for key, doc in field_docs(cls).items():
            assert key in model and not model[key].is_required, (name, key)
            assert f"{doc} Default: " in model[key].description
            assert f"({name})" in model[key].description
    assert "(digits-cnn)" in model["dropout"].description
    assert "(text-lm)" in model["dropout"].description


def test_a_config_of_another_family_than_the_snapshot_is_refused_naming_both(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    from pipeline.trainer.reporting import StdoutReporter
    from pipeline.trainer.train import run_training

    digits = TrainConfig.from_dict({"snapshot_dir": str(snapshot_dir), "max_steps": 2})
    out = io.StringIO()
    code = run_training(digits, run_id="mismatch", store=tmp_path, reporter=StdoutReporter(out))
    assert code == exit_codes.CONFIG_ERROR
    [finished] = [e for e in parse_events(out.getvalue()) if e["event"] == "attempt_finished"]
    assert "model_family: is digits-cnn" in finished["detail"]
    assert f"snapshot {snapshot_dir.name} holds text-lm data" in finished["detail"]
    assert not checkpoint_dirs(tmp_path / "mismatch")  # nothing trained, nothing saved


def test_the_text_lm_demo_config_loads_and_its_eval_metric_ranks_checkpoints(
    snapshot_dir: Path,
) -> None:
    from pipeline.trainer.config import named_config

    section = named_config("text-lm")
    config = TrainConfig.from_dict({**section, "snapshot_dir": str(snapshot_dir)})
    assert config.model_family == "text-lm" and config.model.block_size == 64  # type: ignore[union-attr]
    assert config.best_metric in family("text-lm").metrics


def test_warm_up_climbs_linearly_then_follows_the_schedule_and_is_left_out_of_old_digests(
    tmp_path: Path,
) -> None:
    from pipeline.trainer.train import build_optimizer

    base = {"snapshot_dir": str(tmp_path), "max_steps": 20, "learning_rate": 0.01}
    cosine = {"kind": "cosine", "min_lr": 0.001}
    plain = TrainConfig.from_dict({**base, "lr_schedule": cosine})
    warmed = TrainConfig.from_dict({**base, "lr_schedule": {**cosine, "warmup_steps": 4}})
    # A config that never set warmup_steps hashes as it did before the key existed.
    assert "warmup_steps" not in plain.trajectory_dict()["lr_schedule"]
    assert warmed.trajectory_dict()["lr_schedule"]["warmup_steps"] == 4
    assert plain.sha256() != warmed.sha256()

    def rates(config: TrainConfig) -> list[float]:
        model = torch.nn.Linear(2, 1)
        optimizer, scheduler = build_optimizer(config, model)
        seen = []
        for _ in range(20):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    cosine_rates, warm_rates = rates(plain), rates(warmed)
    assert warm_rates[:4] == pytest.approx(
        [c * (s + 1) / 4 for s, c in enumerate(cosine_rates[:4])]
    )
    assert warm_rates[4:] == pytest.approx(cosine_rates[4:])
    with pytest.raises(ConfigError, match=r"lr_schedule\.warmup_steps: must be >= 0"):
        TrainConfig.from_dict({**base, "lr_schedule": {"warmup_steps": -1}})


# -- the spike drill corrupts a text batch within the vocabulary -----------------------------


def test_the_spike_fault_permutes_text_targets_and_the_loss_jumps(snapshot_dir: Path) -> None:
    from pipeline.trainer.data import load_training_data

    row = family("text-lm")
    data = load_training_data(
        snapshot_dir, model_family="text-lm", model_section=TEXT_CONFIG["model"]
    )
    torch.manual_seed(0)
    model = row.build_model(TEXT_CONFIG["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for start in range(0, 40 * 16, 16):  # enough to learn the bytes' frequencies
        optimizer.zero_grad()
        batch = slice(start, start + 16)
        row.loss(model(data.train_inputs[batch]), data.train_targets[batch]).backward()
        optimizer.step()
    inputs, targets = data.train_inputs[:16], data.train_targets[:16]
    bad_inputs, bad_targets = row.corrupt(inputs, targets)
    assert torch.equal(bad_inputs, inputs) and bad_targets.shape == targets.shape
    assert int(bad_targets.min()) >= 0 and int(bad_targets.max()) < 257
    assert not torch.equal(bad_targets, targets)
    with torch.no_grad():
        clean, spoiled = row.loss(model(inputs), targets), row.loss(model(bad_inputs), bad_targets)
    assert float(spoiled) > 1.5 * float(clean), (float(clean), float(spoiled))
    metrics = row.evaluate(model, data.eval_inputs, data.eval_targets)
    assert set(metrics) == set(row.metrics) and metrics["eval_bits_per_byte"] < 8.0


# -- SIGKILL at random moments, then resume: bit-exact ----------------------------------------


@pytest.mark.parametrize(("moment", "seed"), KILL_CASES, ids=[f"{m}-{s}" for m, s in KILL_CASES])
def test_text_lm_sigkill_then_resume_in_a_new_process_is_bit_exact(
    server: ForkServer, config: Path, reference: Reference, tmp_path: Path, moment: str, seed: int
) -> None:
    sigkill_then_resume_is_bit_exact(
        server, config, reference, tmp_path / "store", moment=moment, seed=seed,
        interval=INTERVAL, keep_last_k=KEEP_LAST_K,
    )  # fmt: skip


def test_text_lm_checkpoint_restores_in_a_new_rebuild_and_matches_its_probe(
    reference: Reference, workdir: Path
) -> None:
    final = checkpoint_dirs(workdir / "reference" / "reference")[0]
    verdict = restore_check(final)
    assert verdict.step == MAX_STEPS and verdict.probe_comparison == "exact"
    assert verdict.probe_max_abs_diff == 0.0
    metrics = load_checkpoint(final).info.metrics
    assert {"eval_loss", "eval_bits_per_byte", "eval_accuracy"} <= set(metrics)


# -- two ranks under torchrun, sharded checkpoints --------------------------------------------


def _final_weights(store: Path, run_id: str) -> dict[str, torch.Tensor]:
    contents = load_checkpoint(checkpoint_dirs(store / run_id)[0])
    assert contents.info.step == TWO_RANK_STEPS and contents.info.world_size == 2
    return {**contents.model, **{f"opt/{k}": v for k, v in contents.training_tensors.items()}}


def _all_committed_verify(run_dir: Path) -> None:
    for directory in checkpoint_dirs(run_dir):
        verify_checkpoint(directory)


def _log(store: Path, run_id: str) -> str:
    path = store / f"{run_id}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.mark.slow
def test_text_lm_two_ranks_killed_and_stopped_resume_bit_exact_with_dcp_shards(
    workdir: Path, snapshot_dir: Path
) -> None:
    """One rank SIGKILLed at random moments (once inside a checkpoint write), then every rank
    SIGTERMed; each resume in new processes; the final weights and optimizer state equal an
    uninterrupted two-rank run's, bit for bit, and the checkpoints are DCP shards."""
    from bench.kill_drill import write_config

    config = write_config(
        workdir / "two-rank-config",
        snapshot_dir,
        max_steps=TWO_RANK_STEPS,
        checkpoint_every_steps=INTERVAL,
        keep_last_k=KEEP_LAST_K,
        **{key: TEXT_CONFIG[key] for key in ("model_family", "model", "batch_size")},
    )
    reference_store = workdir / "two-rank-reference"
    process = launch_ranks(config, reference_store, "ref").process
    assert process.wait(timeout=300) == 0, _log(reference_store, "ref")
    newest = checkpoint_dirs(reference_store / "ref")[0]
    assert sorted(p.name for p in newest.glob("*.distcp")), "no DCP shards in the checkpoint"
    reference = _final_weights(reference_store, "ref")

    store, run_id = workdir / "two-rank-drill", "drill"
    log = store / f"{run_id}.log"
    rng = random.Random(0)
    kills = 0
    for kill in range(2):
        env = {"TRACKS_FAULT_SLEEP_BEFORE_COMMIT": "5"} if kill == 1 else {}
        started = log.read_text().count('"attempt_started"') if log.exists() else 0
        process = launch_ranks(config, store, run_id, env=env, log=log).process
        deadline = time.monotonic() + 120
        while (log.read_text().count('"attempt_started"') if log.exists() else 0) <= started:
            assert process.poll() is None, _log(store, run_id)
            assert time.monotonic() < deadline, "the attempt never started"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.25))
        ranks = trainer_rank_pids(process.pid)
        if ranks:
            try:
                os.kill(ranks[rng.choice(sorted(ranks))], signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass
        code = process.wait(timeout=120)
        if code == exit_codes.SUCCEEDED:
            break  # the run finished before the kill landed
        assert code in (128 + signal.SIGKILL, exit_codes.INFRA_TRANSIENT), (code, kill)
        _all_committed_verify(store / run_id)  # nothing without COMMITTED is ever read
    assert kills >= 1, f"only {kills} kills landed"

    # SIGTERM every rank (through the launcher): they agree on a step, save, and exit 75.
    started = log.read_text().count('"attempt_started"')
    process = launch_ranks(
        config, store, run_id, env={"TRACKS_FAULT_SLEEP_AFTER_STEP": "60"}, log=log
    ).process
    while log.read_text().count('"attempt_started"') <= started:
        assert process.poll() is None, _log(store, run_id)
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGTERM)
    code = process.wait(timeout=120)
    if code != exit_codes.SUCCEEDED:
        assert code == exit_codes.PREEMPTED, _log(store, run_id)
    assert launch_ranks(config, store, run_id, log=log).process.wait(timeout=300) == 0, _log(
        store, run_id
    )
    _all_committed_verify(store / run_id)
    final = _final_weights(store, run_id)
    assert final.keys() == reference.keys()
    different = [k for k in final if not torch.equal(final[k], reference[k])]
    assert not different, f"not bit-exact: {different[:5]}"
