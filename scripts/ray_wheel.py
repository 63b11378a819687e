"""Ray for the GPU machine, which reaches no package registry: its cp312 wheel without the
Java workers, and the dependencies the machine's image lacks, in one folder to carry.

    python3 scripts/ray_wheel.py [--dir .raywhl] [--version 2.60.0]

Run where pip reaches a registry. It downloads Ray's manylinux cp312 wheel and the wheels of
the dependencies missing from the GPU image (``MISSING``: the image has every other one
Ray needs), then rewrites the Ray wheel without ``ray/jars/`` (Java support, about 31 MiB)
and drops those files' lines from its ``RECORD``; everything else is copied byte for byte,
with its permissions (Ray's binaries stay executable) and dates, under the same file name.
It prints each file's size and the total, which must fit the device tool's carry (64 MiB
with everything else). There, install with::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .raywhl/*.whl
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DROPPED = "ray/jars/"
MISSING = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
"""Ray's dependencies that the GPU image (Python 3.12) does not have; it has attrs, certifi,
charset-normalizer, click, filelock, idna, msgpack, packaging, protobuf, pyyaml, requests,
typing-extensions and urllib3."""
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux2014_x86_64"]


def download(names: list[str], folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PLATFORM,
                    "-d", str(folder), *names], check=True)


def without_jars(wheel: Path) -> tuple[int, int]:
    """Rewrite ``wheel`` in place without ``ray/jars/``; return (files dropped, bytes saved)."""
    before = wheel.stat().st_size
    dropped = 0
    handle, temporary = tempfile.mkstemp(suffix=".whl", dir=wheel.parent)
    os.close(handle)
    try:
        with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(temporary, "w") as target:
            for info in source.infolist():
                if info.filename.startswith(DROPPED):
                    dropped += 1
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode("utf-8").splitlines(keepends=True)
                    data = "".join(line for line in lines
                                   if not line.startswith(DROPPED)).encode("utf-8")
                # the same name, date, permissions and compression as in Ray's wheel
                target.writestr(info, data, compress_type=info.compress_type)
        with zipfile.ZipFile(temporary) as check:
            bad = check.testzip()
            if bad is not None:
                raise RuntimeError(f"the rebuilt wheel is damaged at {bad}")
            names = check.namelist()
            if any(name.startswith(DROPPED) for name in names):
                raise RuntimeError("ray/jars/ is still in the rebuilt wheel")
        os.replace(temporary, wheel)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return dropped, before - wheel.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(".raywhl"))
    parser.add_argument("--version", default="2.60.0")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    download([f"ray=={args.version}"], args.dir)
    download(list(MISSING), args.dir)
    (wheel,) = args.dir.glob(f"ray-{args.version}-cp312-*.whl")
    dropped, saved = without_jars(wheel)
    print(f"{wheel.name}: {dropped} files of {DROPPED} dropped, {saved / 2**20:.1f} MiB saved")
    total = 0
    for path in sorted(args.dir.glob("*.whl")):
        size = path.stat().st_size
        total += size
        print(f"{size / 2**20:8.2f} MiB  {path.name}")
    print(f"{total / 2**20:8.2f} MiB  in all, in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
