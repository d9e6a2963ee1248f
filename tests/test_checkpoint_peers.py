"""The benchmark's peers save what they claim and restore it exactly; the training windows run.

``bench/checkpoint_bench.py`` compares Tracks with ``torch.save``, safetensors and DCP. A peer
that saved the wrong tensors, restored nothing, or let an asynchronous save read parameters the
next ``optimizer.step()`` had already changed would make that comparison a fiction, so each
one is checked here on a small model: the saved state is the state at ``start``, and a restore
brings it back bit for bit into a model that has trained on since.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.staging import DefaultStager

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))  # checkpoint_bench imports its peers as the script does

import checkpoint_bench as bench  # noqa: E402
from checkpoint_peers import Loop, PeerFigures, all_peers  # noqa: E402

from pipeline.checkpoint import CheckpointConfig, CheckpointManager, TrainingState  # noqa: E402

PEERS = [peer.name for peer in all_peers()]
WIDTH = 256


def small_state() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8)
    )
    return TrainingState(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        data_cursor=bench.Cursor(),
        config={"test": "peers"},
        config_sha256="c" * 64,
        probe_inputs=torch.randn(2, WIDTH),
    )


def snapshot(state: TrainingState) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer, by name (a restore may reorder a param's
    optimizer state: safetensors returns its keys sorted)."""
    tensors = {f"model.{k}": t.detach().clone() for k, t in state.model.state_dict().items()}
    for index, per_param in state.optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            tensors[f"optimizer.{index}.{key}"] = value.clone()
    return tensors


def live_tensors(state: TrainingState) -> list[torch.Tensor]:
    tensors = list(state.model.state_dict().values())
    for per_param in state.optimizer.state.values():
        tensors += [t for t in per_param.values() if torch.is_tensor(t)]
    return tensors


def loop_for(state: TrainingState) -> Loop:
    inputs, targets = torch.randn(4, WIDTH), torch.randn(4, 8)

    def forward_backward() -> None:
        state.optimizer.zero_grad(set_to_none=True)
        F.mse_loss(state.model(inputs), targets).backward()

    def optimizer_step() -> None:
        state.optimizer.step()

    return Loop(forward_backward, optimizer_step)


@pytest.mark.parametrize("name", PEERS)
def test_a_peer_saves_the_state_at_start_and_restores_it_bit_exact(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's stager copies on a thread of its own: held back 0.2 s, a copy that staged() did
    # not wait for would read the tensors overwritten below, every time, not by chance.
    stage = DefaultStager._stage

    def late_stage(self: DefaultStager, *args: object, **kwargs: object) -> object:
        time.sleep(0.2)
        return stage(self, *args, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", late_stage)
    state, peer = small_state(), next(p for p in all_peers() if p.name == name)
    loop = loop_for(state)
    # Three saves of three states by the same peer (DCP's stager is kept between saves).
    for round_no in range(3):
        loop.forward_backward()
        loop.optimizer_step()
        saved = snapshot(state)

        # The training loop's order: the state may change once staged() returns, and the save
        # is durable at the end. Every tensor is overwritten the moment staged() returns: a
        # peer whose staged() returned before its copy was done would save the overwritten
        # bytes (with the stager's wait removed, this fails every time).
        target = tmp_path / f"ckpt-{round_no}"
        pending = peer.start(state.model, state.optimizer, target)
        pending.staged()
        with torch.no_grad():
            for tensor in live_tensors(state):
                tensor.fill_(7.0)
        pending.durable()

        peer.restore(state.model, state.optimizer, target)
        restored = snapshot(state)
        assert restored.keys() == saved.keys()
        assert len(saved) == 4 + 3 * 4  # weights, biases; Adam: step and two moments each
        for key, before in saved.items():
            assert torch.equal(before, restored[key]), f"round {round_no}: {key}"
        assert state.optimizer.state_dict()["state"][0]["step"] == 1 + round_no
    peer.close()


def test_the_training_windows_run_every_side_and_leave_no_checkpoint_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "settle", lambda seconds=0.0: None)  # no pauses for a small state
    state = small_state()
    manager = CheckpointManager(tmp_path / "run", CheckpointConfig(keep_last_k=100), run_id="bench")
    manager.bind_attempt(1, None)
    peers = all_peers()
    rows = [PeerFigures("Tracks save"), PeerFigures("Tracks save_async")]
    rows += [PeerFigures(peer.name) for peer in peers]
    args = argparse.Namespace(repeats=2, save_every=2)
    inputs, targets = torch.randn(4, WIDTH), torch.randn(4, 8)
    saved_steps: list[int] = []
    save = manager.save

    def counting_save(saving: TrainingState) -> object:
        saved_steps.append(saving.step)
        return save(saving)

    monkeypatch.setattr(manager, "save", counting_save)
    plain = bench.training_side_by_side(
        args, tmp_path, state, manager, peers, rows, inputs, targets, print
    )
    for peer in peers:
        peer.close()

    assert len(plain) == 2 and all(rate > 0 for rate in plain)
    for row in rows:
        assert len(row.training) == 2 and all(rate > 0 for rate in row.training), row.name
    # Two windows of 2 x save_every steps, two saves each, at the middle of each save_every.
    assert len(saved_steps) == 4
    # 8 sides (no saves, Tracks twice, 5 peers) x 2 repeats x 4 steps: every window ran whole.
    assert state.step == 8 * 2 * 4
    assert not list((tmp_path / "run").glob("step-*")) and not (tmp_path / "window").exists()
