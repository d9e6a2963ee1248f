"""Text landing files: the corpus written as Parquet (clean or spoiled on purpose), and read back.

Where invalid UTF-8 is caught: here, reading the bytes. A Parquet ``string`` column is meant
to hold UTF-8, but nothing stops a producer from writing other bytes into one (pyarrow writes
them; ``to_pandas`` then dies with "Wrapping … failed", naming no row). So the reader never
decodes strictly: it reads every string or binary column as bytes and decodes with
``surrogateescape``, which keeps each bad byte as a lone surrogate (U+DC80..U+DCFF). No row is
lost or altered, and the contract's ``valid_utf8`` rule then fails naming the rule and the
rows (see :mod:`pipeline.textlm.contract`).
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import ids, safepath
from pipeline.data.landing import write_table_atomically
from pipeline.textlm.columns import DOC_ID, SPLIT, SPLIT_EVAL, SPLIT_TRAIN, TEXT
from pipeline.textlm.corpus import CorpusInfo, Document, build_documents

DEFAULT_FILE_NAME = "text.parquet"
CORPUS_METADATA_KEY = b"tracks.corpus"
_STRINGY = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


class TextDrift(StrEnum):
    """Ways to land bad text on purpose (tests, drills, a later ``tracks landing text``)."""

    INVALID_UTF8 = "invalid_utf8"  # two documents carry bytes that are not UTF-8
    EMPTY_DOCUMENT = "empty_document"  # two documents are empty or whitespace only
    DUPLICATE_ID = "duplicate_id"  # an eval document reuses a train document's id
    SPLIT_LEAK = "split_leak"  # an eval document's text is also a train document's text
    SHOUTED = "shouted"  # every letter upper-cased: valid, but the characters moved


def write_text_landing(
    landing_dir: Path,
    *,
    drift: TextDrift | None = None,
    file_name: str | None = None,
    documents: list[Document] | None = None,
) -> Path:
    """Write the corpus (or ``documents``) as one Parquet file in ``landing_dir``.

    Columns ``doc_id``, ``split``, ``text`` (Parquet strings); the file's key-value metadata
    carries :class:`CorpusInfo` under ``tracks.corpus``, so the bytes a snapshot copies say
    which corpus, Python version and digest they hold. Same arguments, same bytes; the file
    appears atomically.
    """
    info: CorpusInfo | None = None
    if documents is None:
        documents, info = build_documents()
    if drift is not None:
        documents = spoil(documents, TextDrift(drift))
    # Encoded with surrogateescape and stored unvalidated, so a spoiled row's raw bytes reach
    # the file exactly as a bad producer's would.
    encoded = [d.text.encode("utf-8", "surrogateescape") for d in documents]
    table = pa.table(
        {
            DOC_ID: pa.array([d.doc_id for d in documents], pa.string()),
            SPLIT: pa.array([d.split for d in documents], pa.string()),
            TEXT: pa.array(encoded, pa.binary()).view(pa.string()),
        }
    )
    metadata: dict[str, Any] = {"corpus": info.to_dict() if info else None}
    if drift is not None:
        metadata["drift"] = str(drift)
    table = table.replace_schema_metadata(
        {CORPUS_METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()}
    )
    name = ids.landing_file_name(file_name or DEFAULT_FILE_NAME)
    folder = safepath.no_symlinked_folder(Path(landing_dir), "the landing folder")
    path = safepath.under(folder, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table_atomically(table, path)
    return path


def spoil(documents: list[Document], drift: TextDrift) -> list[Document]:
    """``documents`` spoiled in one known way (the first rows of each split are the victims)."""
    docs = list(documents)
    train = [i for i, d in enumerate(docs) if d.split == SPLIT_TRAIN]
    evals = [i for i, d in enumerate(docs) if d.split == SPLIT_EVAL]
    if drift is TextDrift.INVALID_UTF8:
        for i in (train[0], evals[0]):
            # Latin-1 bytes mid-text: what a producer that never re-encoded its input writes.
            bad = docs[i].text[:40] + b"caf\xe9 \xff\xfe".decode("utf-8", "surrogateescape")
            docs[i] = Document(docs[i].doc_id, docs[i].split, bad + docs[i].text[40:])
    elif drift is TextDrift.EMPTY_DOCUMENT:
        docs[train[1]] = Document(docs[train[1]].doc_id, SPLIT_TRAIN, "")
        docs[evals[1]] = Document(docs[evals[1]].doc_id, SPLIT_EVAL, " \n\t ")
    elif drift is TextDrift.DUPLICATE_ID:
        docs[evals[2]] = Document(docs[train[2]].doc_id, SPLIT_EVAL, docs[evals[2]].text)
    elif drift is TextDrift.SPLIT_LEAK:
        docs[evals[3]] = Document(docs[evals[3]].doc_id, SPLIT_EVAL, docs[train[3]].text)
    elif drift is TextDrift.SHOUTED:
        docs = [Document(d.doc_id, d.split, d.text.upper()) for d in docs]
    else:
        raise AssertionError(f"unhandled drift {drift!r}")
    return docs


def read_text_frame(path: Path) -> pd.DataFrame:
    """One text landing (or snapshot) file as a frame; never fails on bad bytes.

    String and binary columns are decoded from their raw bytes with ``surrogateescape`` (see
    the module docstring); other columns are converted as pyarrow does. Nulls stay None.
    """
    table = pq.read_table(path)
    columns: dict[str, Any] = {}
    for field, column in zip(table.schema, table.columns, strict=True):
        if field.type in _STRINGY:
            raw = column.cast(pa.large_binary()).to_pylist()
            columns[field.name] = pd.Series(
                [None if b is None else b.decode("utf-8", "surrogateescape") for b in raw],
                dtype=object,
            )
        else:
            columns[field.name] = column.to_pandas()
    return pd.DataFrame(columns)


def read_text_snapshot_frame(snapshot: Any, *, verify: bool = True) -> pd.DataFrame:
    """All rows of a text snapshot (``pipeline.data.snapshot.Snapshot``), in manifest order."""
    from pipeline.data.snapshot import verify_snapshot

    if verify:
        verify_snapshot(snapshot)
    frames = [read_text_frame(snapshot.data_dir / e["name"]) for e in snapshot.manifest["files"]]
    return pd.concat(frames, ignore_index=True) if len(frames) != 1 else frames[0]


def corpus_metadata(path: Path) -> dict[str, Any] | None:
    """What a landing file says about its corpus (``tracks.corpus``), or None if it says nothing."""
    metadata = pq.read_schema(path).metadata or {}
    raw = metadata.get(CORPUS_METADATA_KEY)
    return json.loads(raw) if raw is not None else None


def documents_from_frame(frame: pd.DataFrame) -> list[Document]:
    """The frame's rows as documents, in row order (for a frame that passed the contract)."""
    return [
        Document(str(doc_id), str(split), str(text))
        for doc_id, split, text in zip(frame[DOC_ID], frame[SPLIT], frame[TEXT], strict=True)
    ]
