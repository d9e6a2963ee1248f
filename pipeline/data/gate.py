"""The data gate: every path that trains requires the blocking checks' verdict for the exact
manifest it will read.

The verdict is recorded where the checks ran — in the ledger (``snapshots``,
``snapshot_checks``) and, so a trainer without a ledger is held to it too, in a verdict file
``<snapshot_root>/.checks/<snapshot_id>.<manifest digest>.json`` — keyed by the manifest's
sha256. An edited manifest has another digest, so no earlier verdict vouches for it. A snapshot
nobody checked yet is checked here, on the spot, before anything trains on it.

The gate reads each check's newest verdict (``snapshot_checks``); every evaluation of a check
is also kept, append-only, in ``snapshot_check_history``, which ``tracks explain`` lists.

Which checks run is the snapshot's family's business (:func:`blocking_outcomes`,
:func:`drift_outcome`: the digits' pandera and great-expectations suites, or the text ones in
:mod:`pipeline.textlm`); the check names and the verdict machinery are the same for every family.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import ids, safepath
from pipeline.data.checks import CheckOutcome
from pipeline.data.errors import BlockedSnapshotError, SnapshotTamperedError
from pipeline.data.families import TEXT
from pipeline.data.snapshot import Snapshot, list_snapshots, read_snapshot_frame
from pipeline.digests import sha256_json
from pipeline.durable import make_dir_durably, replace_atomically

if TYPE_CHECKING:
    import pandas as pd

    from pipeline.ledger import Ledger

SCHEMA_CONTRACT = "schema_contract"
DATA_QUALITY = "data_quality"
DRIFT_VS_PREVIOUS = "drift_vs_previous"
BLOCKING_CHECKS = (SCHEMA_CONTRACT, DATA_QUALITY)
VERDICTS_DIR = ".checks"


@dataclass(frozen=True)
class CheckVerdict:
    """One check's outcome on one exact manifest."""

    check: str
    blocking: bool
    passed: bool
    summary: str
    failures: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, outcome: CheckOutcome, *, blocking: bool) -> CheckVerdict:
        payload = outcome.to_dict()
        return cls(
            check=outcome.check,
            blocking=blocking,
            passed=outcome.passed,
            summary=outcome.summary,
            failures=tuple(payload.get("failures") or ()),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "blocking": self.blocking,
            "passed": self.passed,
            "summary": self.summary,
            "failures": list(self.failures),
        }


def content_sha256(snapshot: Snapshot) -> str:
    """A digest of the data's bytes alone, in file order, whatever the files are named.

    The snapshot id covers names too (a file's name is part of what a reader sees); this one
    lets `tracks explain` say when two snapshots hold byte-identical data.
    """
    return sha256_json([[f["sha256"], f["bytes"]] for f in snapshot.manifest["files"]])


def read_check_frame(snapshot: Snapshot, *, verify: bool = True) -> pd.DataFrame:
    """The snapshot's rows as its family's checks read them (verified first unless told not to).

    Text is read by :func:`pipeline.textlm.landing.read_text_snapshot_frame`, which keeps bytes
    that are not UTF-8 (as lone surrogates) for the contract to name, where pyarrow's reader
    would fail naming no row.
    """
    if snapshot.family == TEXT:
        from pipeline.textlm.landing import read_text_snapshot_frame

        return read_text_snapshot_frame(snapshot, verify=verify)
    return read_snapshot_frame(snapshot, verify=verify)


def blocking_outcomes(snapshot: Snapshot, frame: pd.DataFrame) -> tuple[CheckOutcome, ...]:
    """The family's blocking checks on ``frame`` (the snapshot's rows): the pandera contract
    (``schema_contract``), then the great-expectations suite (``data_quality``)."""
    # Imported per family: a digits trainer never loads the text checks, nor the reverse.
    if snapshot.family == TEXT:
        from pipeline.textlm.contract import check_text_contract
        from pipeline.textlm.quality import check_text_quality

        return check_text_contract(frame), check_text_quality(frame)
    from pipeline.data.contract import check_schema_contract
    from pipeline.data.quality import check_data_quality

    return check_schema_contract(frame), check_data_quality(frame)


def drift_outcome(
    snapshot: Snapshot, frame: pd.DataFrame, previous: pd.DataFrame | None
) -> CheckOutcome:
    """``drift_vs_previous`` for the snapshot's family: ``previous`` is the baseline's rows
    (:func:`drift_baseline`), None when there is none."""
    if snapshot.family == TEXT:
        from pipeline.textlm.drift import drift_vs_previous as text_drift

        return text_drift(frame, previous)
    from pipeline.data.drift import drift_vs_previous

    return drift_vs_previous(frame, previous)


def drift_baseline(
    snapshot: Snapshot, *, snapshot_root: Path, ledger: Ledger | None
) -> Snapshot | None:
    """The newest other snapshot of the same family whose blocking checks passed, or None.

    A snapshot that failed its checks is no baseline (drift against bad data says nothing),
    and nor is another family's: text bytes against digit pixels is no distance at all.
    """
    earlier = [
        s
        for s in list_snapshots(snapshot_root)
        if s.snapshot_id != snapshot.snapshot_id and s.family == snapshot.family
    ]
    for candidate in reversed(earlier):
        if passed_checks(candidate, snapshot_root=snapshot_root, ledger=ledger):
            return candidate
    return None


def run_blocking_checks(
    snapshot: Snapshot, frame: pd.DataFrame | None = None
) -> list[CheckVerdict]:
    """The family's pandera contract and great-expectations suite on the verified snapshot."""
    frame = read_check_frame(snapshot) if frame is None else frame
    return [CheckVerdict.of(o, blocking=True) for o in blocking_outcomes(snapshot, frame)]


def verdict_path(snapshot_root: Path, snapshot: Snapshot) -> Path:
    name = f"{ids.snapshot_id(snapshot.snapshot_id)}.{snapshot.manifest_sha256}.json"
    return safepath.under(Path(snapshot_root).resolve(), VERDICTS_DIR, name)


def record_verdict(
    snapshot: Snapshot,
    verdicts: Sequence[CheckVerdict],
    *,
    snapshot_root: Path,
    ledger: Ledger | None = None,
    dagster_run_id: str | None = None,
) -> None:
    """Record ``verdicts`` for the snapshot's exact manifest: a verdict file, and the ledger."""
    path = verdict_path(snapshot_root, snapshot)
    make_dir_durably(path.parent)
    existing = _read_file(path) or {}
    merged = {**existing, **{v.check: v.to_dict() for v in verdicts}}
    payload = {
        "snapshot_id": snapshot.snapshot_id,
        "manifest_sha256": snapshot.manifest_sha256,
        "recorded_at": datetime.now(UTC).isoformat(),
        "checks": merged,
    }
    replace_atomically(path, json.dumps(payload, indent=1, sort_keys=True).encode())
    if ledger is not None:
        register(snapshot, ledger, dagster_run_id=dagster_run_id)
        from pipeline.ledger import SnapshotCheckRecord

        now = datetime.now(UTC)
        ledger.record_snapshot_checks(
            snapshot.snapshot_id,
            snapshot.manifest_sha256,
            [
                SnapshotCheckRecord(
                    snapshot_id=snapshot.snapshot_id,
                    manifest_sha256=snapshot.manifest_sha256,
                    check_name=v.check,
                    blocking=v.blocking,
                    passed=v.passed,
                    checked_at=now,
                    detail={"summary": v.summary, "failures": list(v.failures)},
                    dagster_run_id=dagster_run_id,
                )
                for v in verdicts
            ],
        )


def register(snapshot: Snapshot, ledger: Ledger, *, dagster_run_id: str | None = None) -> None:
    """The snapshot's ledger row; a manifest that differs from the registered one is refused."""
    from pipeline.ledger import SnapshotManifestChangedError

    try:
        ledger.register_snapshot(
            snapshot_id=snapshot.snapshot_id,
            manifest_sha256=snapshot.manifest_sha256,
            content_sha256=content_sha256(snapshot),
            rows=snapshot.row_count,
            source=snapshot.manifest.get("source"),
            dagster_run_id=dagster_run_id,
        )
    except SnapshotManifestChangedError as exc:
        raise SnapshotTamperedError(snapshot.snapshot_id, str(exc)) from exc


def recorded_verdict(
    snapshot: Snapshot, *, snapshot_root: Path, ledger: Ledger | None = None
) -> dict[str, CheckVerdict]:
    """The blocking-check verdicts recorded for this exact manifest.

    With a ledger, the ledger alone says what was checked: a verdict file is plain bytes that
    anyone can write beside a snapshot, and trusting it would train on data the ledger calls
    unchecked. No ledger rows means no verdict, so the caller checks the snapshot now. The file
    only serves a trainer that runs without a ledger.
    """
    found: dict[str, CheckVerdict] = {}
    if ledger is not None:
        register(snapshot, ledger)  # refuses an edited manifest
        for row in ledger.snapshot_checks(snapshot.snapshot_id, snapshot.manifest_sha256):
            detail = row.detail or {}
            found[row.check_name] = CheckVerdict(
                check=row.check_name,
                blocking=row.blocking,
                passed=row.passed,
                summary=str(detail.get("summary", "")),
                failures=tuple(detail.get("failures") or ()),
            )
    if not found:
        path = verdict_path(snapshot_root, snapshot)
        others = [
            p.name
            for p in path.parent.glob(f"{snapshot.snapshot_id}.*.json")
            if p.name != path.name
        ]
        if others and not path.exists():
            # Checked before under another manifest digest: the manifest was edited since.
            raise SnapshotTamperedError(
                snapshot.snapshot_id,
                f"manifest.json has sha256 {snapshot.manifest_sha256}, but its checks were "
                f"recorded for another manifest ({others[0].split('.')[1][:16]}…): the manifest "
                "was changed after the snapshot was made",
            )
        if ledger is not None:
            return found
        for name, value in (_read_file(path) or {}).items():
            if isinstance(value, dict):
                found[name] = CheckVerdict(
                    check=name,
                    blocking=bool(value.get("blocking")),
                    passed=bool(value.get("passed")),
                    summary=str(value.get("summary", "")),
                    failures=tuple(value.get("failures") or ()),
                )
    return found


def ensure_checks_passed(
    snapshot: Snapshot,
    *,
    snapshot_root: Path,
    ledger: Ledger | None = None,
    dagster_run_id: str | None = None,
) -> dict[str, CheckVerdict]:
    """Return the passing blocking verdicts for ``snapshot``, or raise BlockedSnapshotError.

    Every path that trains calls this: the ``training_attempt`` asset (even materialized on
    its own), the trainer process (orchestrated or from the CLI). A verdict missing for this
    manifest is produced now and recorded.
    """
    verdicts = recorded_verdict(snapshot, snapshot_root=snapshot_root, ledger=ledger)
    if not all(name in verdicts for name in BLOCKING_CHECKS):
        record_verdict(
            snapshot,
            run_blocking_checks(snapshot),
            snapshot_root=snapshot_root,
            ledger=ledger,
            dagster_run_id=dagster_run_id,
        )
        verdicts = recorded_verdict(snapshot, snapshot_root=snapshot_root, ledger=ledger)
    failed = {name: verdicts[name].summary for name in BLOCKING_CHECKS if not verdicts[name].passed}
    if failed:
        raise BlockedSnapshotError(snapshot.snapshot_id, snapshot.manifest_sha256, failed)
    return verdicts


def passed_checks(snapshot: Snapshot, *, snapshot_root: Path, ledger: Ledger | None) -> bool:
    """Whether a verdict recorded for this exact manifest says every blocking check passed."""
    try:
        verdicts = recorded_verdict(snapshot, snapshot_root=snapshot_root, ledger=ledger)
    except SnapshotTamperedError:
        return False
    return all(name in verdicts and verdicts[name].passed for name in BLOCKING_CHECKS)


def _read_file(path: Path) -> dict[str, Any] | None:
    try:
        fd = safepath.open_regular_nofollow(path)
    except (FileNotFoundError, safepath.UnsafePathError, OSError):
        return None
    with open(fd, "rb") as handle:
        try:
            payload = json.loads(handle.read())
        except (ValueError, UnicodeDecodeError):
            return None
    checks = payload.get("checks") if isinstance(payload, dict) else None
    return checks if isinstance(checks, dict) else None
