"""The door's shared library: found prebuilt, or compiled from ``door.c`` once into a cache.

The library is plain C with no Python in it, so it is not a Python extension: it is built on
first use (``gpubudget run`` calls :func:`library`) with the system's C compiler (``$CC``, else
``cc``, ``gcc`` or ``clang``) into ``$GPUBUDGET_DOOR_CACHE``, else
``$XDG_CACHE_HOME/gpubudget``, else ``~/.cache/gpubudget``, under a name made from a hash of
the source and the flags: a changed ``door.c`` gets a new file, and processes building at the
same time each write their own temporary file and rename it into place. Where no compiler
exists, ``GPUBUDGET_DOOR_LIB`` names a library built elsewhere (``python -m
gpubudget.door.build`` prints where this machine's is).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

from ..errors import raise_if_from_outside

__all__ = ["DoorUnavailable", "LIB_ENV", "SOURCE", "VERSION", "compiler", "library",
           "version_of"]

SOURCE: Final = Path(__file__).with_name("door.c")
LIB_ENV: Final = "GPUBUDGET_DOOR_LIB"
CACHE_ENV: Final = "GPUBUDGET_DOOR_CACHE"
FLAGS: Final = ("-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                "-fno-delete-null-pointer-checks", "-Wall", "-Wno-nonnull-compare")
LIBS: Final = ("-ldl", "-lpthread")
VERSION: Final = 2
"""The door's version this gpubudget needs (door.c's GBD_VERSION and its tag)."""
_TAG: Final = re.compile(rb"gpubudget driver door, version (\d+)\.")


class DoorUnavailable(RuntimeError):
    """The door's library cannot be had here: no compiler, or the build failed."""


def compiler() -> str | None:
    """The C compiler to build with, or ``None`` where there is none."""
    named = os.environ.get("CC", "").strip()
    for candidate in ([named] if named else []) + ["cc", "gcc", "clang"]:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def _cache() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpubudget"


def library() -> Path:
    """The path of the door's library, built first if need be; ``DoorUnavailable`` (saying
    why) if it cannot be."""
    given = os.environ.get(LIB_ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise DoorUnavailable(f"{LIB_ENV}={given!r} is not a file")
        found = version_of(path)
        if found != VERSION:
            said = "no driver door" if found is None else f"the driver door's version {found}"
            raise DoorUnavailable(f"{LIB_ENV}={given!r} is {said}; this gpubudget needs "
                                  f"version {VERSION} (build it from this gpubudget's "
                                  f"door.c: python -m gpubudget.door.build)")
        return path
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS + LIBS).encode()).hexdigest()[:16]
    target = _cache() / f"libgpubudget_door-{digest}.so"
    if target.is_file():
        _check_owned(target)
        return target
    cc = compiler()
    if cc is None:
        raise DoorUnavailable(f"the driver door is built from C on first use and no C "
                              f"compiler was found (set CC, or {LIB_ENV} to a library built "
                              f"elsewhere)")
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", temporary, str(SOURCE), *LIBS],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line),
                         done.stderr.strip()[:200])
            raise DoorUnavailable(f"building the driver door with {cc} failed: {first}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def version_of(path: Path) -> int | None:
    """The door's version a library file says it is (its tag), without loading it; ``None``
    for a file that is no door (or one older than the tag), or that cannot be read."""
    try:
        found = _TAG.search(path.read_bytes())
    except OSError as exc:
        raise_if_from_outside(exc)
        return None
    return None if found is None else int(found.group(1))


def _check_owned(path: Path) -> None:
    """A library every process of ours will preload must be ours alone to write."""
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise DoorUnavailable(f"{path} is not this user's alone to write (owner uid "
                              f"{status.st_uid}, mode {status.st_mode & 0o777:o}): it is "
                              f"not loaded; remove it, or set {CACHE_ENV} to a directory of "
                              f"your own")


if __name__ == "__main__":  # pragma: no cover - a convenience for building by hand
    try:
        print(library())
    except DoorUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
