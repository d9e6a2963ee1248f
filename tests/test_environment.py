"""Where an attempt ran, read from the variables the trainer manifests Tracks renders set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline import environment
from pipeline.kube.render import render_indexed_job
from pipeline.kube.spec import TrainerSpec

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in ("TRACKS_IMAGE_DIGEST", "TRACKS_IMAGE", "POD_NAME", "NODE_NAME", "POD_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    environment.container_digest.cache_clear()
    yield monkeypatch
    environment.container_digest.cache_clear()


def _rendered_env_names() -> set[str]:
    spec = TrainerSpec(name="t-run-a1", image=f"registry.example/tracks@{DIGEST}")
    [job] = [obj for obj in render_indexed_job(spec) if obj["kind"] == "Job"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    return {item["name"] for item in container["env"]}


def test_placement_reads_what_the_rendered_trainer_pods_set(clean: pytest.MonkeyPatch) -> None:
    names = _rendered_env_names()
    assert {"TRACKS_POD_NAME", "TRACKS_NODE_NAME", "TRACKS_POD_NAMESPACE"} <= names
    clean.setenv("TRACKS_POD_NAME", "t-run-a1-0-abcde")
    clean.setenv("TRACKS_NODE_NAME", "gpu-node-7")
    clean.setenv("TRACKS_POD_NAMESPACE", "training")
    found = environment.placement()
    assert (found["pod"], found["node"], found["namespace"]) == (
        "t-run-a1-0-abcde", "gpu-node-7", "training",
    )  # fmt: skip


def test_a_pinned_image_is_the_container_digest_and_a_tag_is_not(
    clean: pytest.MonkeyPatch,
) -> None:
    assert "TRACKS_IMAGE" in _rendered_env_names()
    clean.setenv("TRACKS_IMAGE", "registry.example/tracks:1.4")
    assert environment.container_digest().startswith("env:sha256:")  # a tag names no build
    environment.container_digest.cache_clear()
    clean.setenv("TRACKS_IMAGE", f"registry.example/tracks@{DIGEST}")
    assert environment.container_digest() == DIGEST
