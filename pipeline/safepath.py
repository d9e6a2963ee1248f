"""Paths that must stay under their root: resolved once, symlinks refused, escapes refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafePathError(ValueError):
    """A path that leaves its root, or passes through a symlink where none is allowed."""

    def __init__(self, path: Path | str, root: Path | str | None, why: str) -> None:
        self.path = Path(path)
        self.root = Path(root) if root is not None else None
        under = f" (must stay under {root})" if root is not None else ""
        super().__init__(f"{path}: {why}{under}")


def child(root: Path, *parts: str) -> Path:
    """``root/parts...`` after checking no component is empty, absolute, ``.`` or ``..``.

    The result is lexically under ``root`` whatever exists on disk; pair it with
    :func:`no_symlinks` before reading or writing through it.
    """
    path = root
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part or "\x00" in part:
            raise UnsafePathError(
                root / part if part else root, root, f"bad path component {part!r}"
            )
        path = path / part
    return path


def no_symlinks(root: Path, path: Path) -> Path:
    """Refuse ``path`` when it is not under ``root`` or any component below ``root`` is a symlink.

    Components that do not exist yet are fine (a folder about to be created). ``root`` itself
    may be a symlink: it is what the operator configured.
    """
    root_abs = Path(os.path.abspath(root))
    path_abs = Path(os.path.abspath(path))
    try:
        rel = path_abs.relative_to(root_abs)
    except ValueError:
        raise UnsafePathError(path, root, "outside its root") from None
    current = root_abs
    for part in rel.parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            break
        if stat.S_ISLNK(mode):
            raise UnsafePathError(current, root, "is a symlink; Tracks does not follow links")
    return path_abs


def no_symlinked_folder(path: Path, what: str) -> Path:
    """``path`` made absolute; refused when it or any folder above it is a symlink.

    For a folder whose whole path is Tracks' to trust, such as the landing folder that
    :class:`~pipeline.settings.TracksSettings` builds: the part the operator configured is
    resolved there already, so a link found here was made later, under ``TRACKS_HOME``, or is
    the folder itself. ``what`` names the folder in the refusal. Missing components are fine.
    """
    absolute = Path(os.path.abspath(path))
    current = Path(absolute.anchor)
    for part in absolute.parts[1:]:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            break
        if stat.S_ISLNK(mode):
            said = (
                f"{what} is a symlink"
                if current == absolute
                else f"a symlink on the way to {what} {absolute}"
            )
            raise UnsafePathError(current, None, f"{said}; Tracks does not follow links")
    return absolute


def under(root: Path, *parts: str) -> Path:
    """:func:`child` then :func:`no_symlinks`: the one call most readers and writers need."""
    return no_symlinks(root, child(root, *parts))


def open_regular_nofollow(path: Path) -> int:
    """An fd for reading ``path``; a symlink as last component or a non-regular file is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(path, path.parent, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd
