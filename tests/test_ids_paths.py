"""The one validation of ids, names and paths that every entry point uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import ids, redact, safepath, yamlio


@pytest.mark.parametrize(
    "bad",
    [
        "",
        ".",
        "..",
        "../../x",
        "/etc/passwd",
        "./victim",
        "a/b",
        "x" * 300,
        ".hidden",
        "a..b",
        "a b",
        7,
    ],
)
def test_run_id_refuses_what_would_leave_its_folder(bad: object) -> None:
    with pytest.raises(ids.InvalidIdError, match="invalid run id"):
        ids.run_id(bad)


def test_run_id_accepts_what_tracks_generates() -> None:
    assert (
        ids.run_id("digits-mlp-0123abcd-20261123T000000-ab12")
        == "digits-mlp-0123abcd-20261123T000000-ab12"
    )


def test_snapshot_id_shape() -> None:
    assert ids.snapshot_id("digits-0123456789abcdef")
    assert ids.is_snapshot_id("digits-0123456789abcdef")
    for bad in ("digits-0123", "../digits-0123456789abcdef", "Digits-0123456789abcdef", ""):
        assert not ids.is_snapshot_id(bad)
        with pytest.raises(ids.InvalidIdError):
            ids.snapshot_id(bad)


@pytest.mark.parametrize(
    "bad", ["../x.parquet", "/tmp/x.parquet", "a/b.parquet", "x.csv", ".x.parquet"]
)
def test_landing_file_name(bad: str) -> None:
    with pytest.raises(ids.InvalidIdError, match="landing file name"):
        ids.landing_file_name(bad)


def test_safepath_refuses_escape_and_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")
    assert safepath.under(root, "real", "new") == root / "real" / "new"
    with pytest.raises(safepath.UnsafePathError, match="symlink"):
        safepath.under(root, "link", "x")
    with pytest.raises(safepath.UnsafePathError):
        safepath.under(root, "..", "outside")
    with pytest.raises(safepath.UnsafePathError, match="outside its root"):
        safepath.no_symlinks(root, outside / "x")
    (outside / "f").write_text("secret")
    os.symlink(outside / "f", root / "real" / "f")
    with pytest.raises(OSError):
        safepath.open_regular_nofollow(root / "real" / "f")


def test_redact_urls_and_text() -> None:
    url = "postgresql+psycopg2://user:secret@127.0.0.1:5432/test"
    assert "secret" not in redact.url(url)
    assert redact.url(url).startswith("postgresql+psycopg2://user:***@127.0.0.1")
    assert redact.url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert "secret" not in redact.text(f"could not connect to {url}: refused")
    assert "secret" not in redact.url("http://h/x?token=secret&a=1")


def test_yaml_duplicate_keys_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.1\nseed: 1\nlr: 0.2\n")
    with pytest.raises(yamlio.YamlError, match=r"c.yaml.*duplicate key 'lr' \(first on line 1\)"):
        yamlio.load_file(path)
    assert yamlio.loads("a: {b: 1}") == {"a": {"b": 1}}
