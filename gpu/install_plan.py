"""Which kit wheels `install.sh` installs into this interpreter (prints their paths, one a line).

For each distribution, among the wheels of the given folders (later folders win), the one whose
tags this interpreter supports. It is skipped when the environment already has the package at
the same version, or at a newer one: never downgrade what the image's torch / transformers run
with. Stdlib, plus `packaging` (on the image; pip's vendored copy otherwise).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging import tags
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - pip always vendors it
    from pip._vendor.packaging import tags  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]


def normalize(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def wheel_tags(wheel: Path) -> set[str]:
    parts = wheel.name[: -len(".whl")].split("-")
    pys, abis, plats = (p.split(".") for p in parts[-3:])
    return {f"{p}-{a}-{pl}" for p in pys for a in abis for pl in plats}


def choose(folders: list[Path]) -> dict[str, Path]:
    """distribution -> installable wheel; a later folder's wheel replaces an earlier one's."""
    supported = {str(t) for t in tags.sys_tags()}
    chosen: dict[str, Path] = {}
    for folder in folders:
        for wheel in sorted(folder.glob("*.whl")):
            if wheel_tags(wheel) & supported:
                chosen[normalize(wheel.name.split("-")[0])] = wheel
    return chosen


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def plan(folders: list[Path]) -> tuple[list[Path], list[str]]:
    todo: list[Path] = []
    notes: list[str] = []
    for dist, wheel in sorted(choose(folders).items()):
        want = wheel.name.split("-")[1]
        have = installed_version(dist)
        if have is not None:
            try:
                newer_or_same = Version(have) >= Version(want)
            except InvalidVersion:
                newer_or_same = have == want
            if newer_or_same:
                notes.append(f"skip {dist} {want}: {have} is installed")
                continue
            notes.append(f"upgrade {dist} {have} -> {want}")
        todo.append(wheel)
    return todo, notes


def main() -> None:
    folders = [Path(a) for a in sys.argv[1:]]
    missing = [str(f) for f in folders if not f.is_dir()]
    if not folders or missing:
        sys.exit(f"usage: install_plan.py WHEEL_DIR...  (not a folder: {missing})")
    todo, notes = plan(folders)
    for note in notes:
        print(note, file=sys.stderr)
    print("\n".join(str(w) for w in todo))


if __name__ == "__main__":
    main()
