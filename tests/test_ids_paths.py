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


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        # Unencoded passwords holding what ends a URL's netloc for urlsplit.
        ("postgresql://u:pa/SECRET@db/x", "postgresql://u:***@db/x"),
        ("postgresql://u:p#SECRET@db/x", "postgresql://u:***@db/x"),
        ("postgresql://u:p@SECRET@db:5432/x", "postgresql://u:***@db:5432/x"),
        # An '@' after the host stays: only the password goes.
        ("postgresql://u:SECRET@db/x?email=a@b.org", "postgresql://u:***@db/x?email=a@b.org"),
        ("redis://:SECRET@localhost:6379/0", "redis://:***@localhost:6379/0"),
        # Query parameters whose name says secret, wherever the word sits in it.
        (
            "sqlite:////t/l.db?uri=true&sslpassword=SECRET",
            "sqlite:////t/l.db?uri=true&sslpassword=***",
        ),
        ("https://h/x?access_token=SECRET&a=1", "https://h/x?access_token=***&a=1"),
        ("https://h/x?client_secret=SECRET", "https://h/x?client_secret=***"),
        # Nothing to hide: unchanged.
        ("http://host:8080/path", "http://host:8080/path"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_redaction_masks_the_whole_password_and_only_it(raw: str, shown: str) -> None:
    assert redact.url(raw) == shown
    # A secret ends at whitespace: a quote after it might be part of it, and is masked too.
    assert redact.text(f"could not connect to {raw} (refused)") == (
        f"could not connect to {shown} (refused)"
    )


def test_yaml_duplicate_keys_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.1\nseed: 1\nlr: 0.2\n")
    with pytest.raises(yamlio.YamlError, match=r"c.yaml.*duplicate key 'lr' \(first on line 1\)"):
        yamlio.load_file(path)
    assert yamlio.loads("a: {b: 1}") == {"a": {"b": 1}}


def test_a_long_message_is_redacted_before_it_is_cut() -> None:
    """Cut first, a URL loses its '@' and no longer looks like one: its password would show."""
    from pipeline.cli import _one_line
    from pipeline.trainer.train import classify_exception

    error = RuntimeError("x" * 570 + " postgresql://tracks:SECRETPASSWORD@db/ledger")
    assert "SECRETPAS" not in _one_line(error)
    assert "SECRETPAS" not in classify_exception(error, step=3).detail


def test_trainer_events_are_redacted_on_stdout() -> None:
    import io
    import json

    from pipeline.trainer.reporting import StdoutReporter

    stream = io.StringIO()
    StdoutReporter(stream).event(
        "error", {"traceback": ["at postgresql://u:SECRET@db/x", {"url": "https://h?token=T0K"}]}
    )
    line = json.loads(stream.getvalue())
    assert line["traceback"] == ["at postgresql://u:***@db/x", {"url": "https://h?token=***"}]
