"""Build the offline GPU kit (`make gpu-kit`): every wheel SGLang + sgl-kvc need on the GPU image.

Output, under `.gpu-kit/` (ignored by git):
- `wheels/`: what goes to the GPU machine: the slimmed sglang wheel (cp312), the dependency
  wheels the image lacks, the sgl_kvc wheel and the shims wheel (`gpu/shims/`);
- `local-pyXY/`: the same compiled wheels for this machine's interpreter, used only by
  `make gpu-kit-check` (never carried);
- `MANIFEST.json`: every file with size and sha256, the totals, the source wheel's sha256;
- `cache/`: the registry downloads, reused by the next build.

Stdlib plus pip (run as a subprocess of this interpreter). Fails if `wheels/` exceeds the limit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

if "slim_wheel" not in sys.modules:  # a script's folder is not on sys.path under PYTHONSAFEPATH
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import slim_wheel  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SGLANG = "sglang==0.5.23"
TARGET_PYTHON = "3.12"  # the GPU image: /opt/torch/.venv/bin/python3, Python 3.12.3
TARGET_TAG = "cp312"
# The sglang wheel is manylinux_2_34; the image is Ubuntu 24.04-like (glibc 2.39).
TARGET_PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64")
LIMIT_MIB = 45.0  # one device call carries 64 MiB, the project tree is ~12 MiB of it
SHIMS_DIST = "sgl_kvc_gpu_shims"
SHIMS_VERSION = "0.1.0"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pinned_requirements(deps_file: Path, pins_file: Path) -> list[str]:
    """`name==version` for every line of `deps_file`; bare names take `pins_file`'s version."""
    pins: dict[str, str] = {}
    for line in pins_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[normalize(name)] = version.strip()
    out = []
    for line in deps_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line:
            if normalize(line) not in pins:
                raise SystemExit(f"{deps_file.name}: {line} has no version in {pins_file}")
            line = f"{line}=={pins[normalize(line)]}"
        out.append(line)
    return out


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd[:8]), "..." if len(cmd) > 8 else "", flush=True)
    subprocess.run(cmd, check=True)


def download(requirements: list[str], dest: Path, target: bool) -> None:
    """Binary wheels only, no dependency resolution (SGLang's metadata pins a CUDA stack)."""
    args = ["download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    if target:
        args += ["--python-version", TARGET_PYTHON, "--implementation", "cp", "--abi", TARGET_TAG]
        for platform in TARGET_PLATFORMS:
            args += ["--platform", platform]
    pip(*args, *requirements)


def wheel_for(requirement: str, folder: Path, accept=lambda wheel: True) -> Path:
    """The downloaded wheel of `name==version` in `folder` (one, if pip left several builds)."""
    name, version = requirement.split("==")
    found = [w for w in sorted(folder.glob("*.whl"))
             if normalize(w.name.split("-")[0]) == normalize(name)
             and w.name.split("-")[1] == version and accept(w)]
    if not found:
        raise SystemExit(f"no wheel for {requirement} in {folder}")
    return found[-1]


def wheel_tags(wheel: Path) -> set[str]:
    """The `py-abi-platform` tags of a wheel file name (compressed tag sets expanded)."""
    parts = wheel.name[: -len(".whl")].split("-")
    pys, abis, plats = (p.split(".") for p in parts[-3:])
    return {f"{p}-{a}-{pl}" for p in pys for a in abis for pl in plats}


def local_tags() -> set[str]:
    try:
        from packaging import tags
    except ImportError:  # pip always vendors it
        from pip._vendor.packaging import tags  # type: ignore[no-redef]
    return {str(t) for t in tags.sys_tags()}


def _has_setuptools(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major


def build_sgl_kvc(dest: Path) -> Path:
    """`pip wheel --no-deps` of the repo, built from a copy: the work tree stays untouched
    (no build/ or egg-info churn for the others working in it)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, src / name)
        # pyproject maps kernels/ and server/ into sgl_kvc (package-dir)
        for folder in ("sgl_kvc", "kernels", "server"):
            shutil.copytree(REPO / folder, src / folder,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        # This interpreter's setuptools when it is recent enough (no download), else pip's own
        # isolated build environment.
        isolation = ["--no-build-isolation"] if _has_setuptools(69) else []
        pip("wheel", "--no-deps", *isolation, "--wheel-dir", str(dest), str(src))
    (wheel,) = dest.glob("sgl_kvc-*.whl")
    # A package missing from pyproject's list still imports from an editable install, but not
    # from this wheel: compare with the tree.
    packages = {Path("sgl_kvc", p.relative_to(REPO / "sgl_kvc")).as_posix()
                for p in (REPO / "sgl_kvc").rglob("__init__.py")}
    packages |= {"sgl_kvc/kernels/__init__.py", "sgl_kvc/server/__init__.py"}
    with zipfile.ZipFile(wheel) as z:
        missing = sorted(packages - set(z.namelist()))
    if missing:
        raise SystemExit(f"{wheel.name} lacks {missing}: add them to pyproject.toml's packages")
    return wheel


def build_shims(dest: Path) -> Path:
    """The `gpu/shims/` files as a pure wheel; the .pth at the wheel root lands in site-packages."""
    shims = Path(__file__).resolve().parent / "shims"
    dist_info = f"{SHIMS_DIST}-{SHIMS_VERSION}.dist-info"
    entries = [slim_wheel.Entry(p.relative_to(shims).as_posix(), p.read_bytes())
               for p in sorted(shims.rglob("*"))
               if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".pth")]
    metadata = (f"Metadata-Version: 2.1\nName: {SHIMS_DIST.replace('_', '-')}\n"
                f"Version: {SHIMS_VERSION}\nSummary: sgl-kvc GPU kit: an import-only sgl_kernel "
                "stub and post-import patches for SGLang without sgl-kernel\n")
    wheel_meta = ("Wheel-Version: 1.0\nGenerator: sgl-kvc gpu/build_kit.py\n"
                  "Root-Is-Purelib: true\nTag: py3-none-any\n")
    entries += [slim_wheel.Entry(f"{dist_info}/METADATA", metadata.encode()),
                slim_wheel.Entry(f"{dist_info}/WHEEL", wheel_meta.encode()),
                slim_wheel.Entry(f"{dist_info}/top_level.txt", b"sgl_kernel\nsgl_kvc_gpu_shims\n")]
    path = dest / f"{SHIMS_DIST}-{SHIMS_VERSION}-py3-none-any.whl"
    slim_wheel.write_wheel(path, entries, dist_info)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(folder: Path) -> dict:
    files = [{"name": p.name, "size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.glob("*.whl"))]
    return {"files": files, "total_bytes": sum(f["size"] for f in files)}


def python_sources(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {n: z.read(n) for n in z.namelist() if n.endswith(".py")}


def build(out: Path, limit_mib: float) -> dict:
    cache_target, cache_local = out / "cache" / TARGET_TAG, out / "cache" / "local"
    wheels = out / "wheels"
    local_name = f"local-py{sys.version_info.major}{sys.version_info.minor}"
    local = out / local_name
    for folder in (wheels, local):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    deps = pinned_requirements(Path(__file__).with_name("kit-deps.txt"),
                               REPO / "requirements" / "cpu.txt")

    download([SGLANG, *deps], cache_target, target=True)
    source = wheel_for(SGLANG, cache_target)
    rule = slim_wheel.sglang_drop_rule(source)
    result = slim_wheel.slim_wheel(source, wheels / source.name, rule)
    print(f"sglang: kept {len(result.kept)} entries, dropped {len(result.dropped)}")
    for requirement in deps:
        shutil.copy2(wheel_for(requirement, cache_target), wheels)

    # Wheels this interpreter cannot install (cp312-only builds) get a local counterpart.
    here = local_tags()
    foreign = [req for req in [SGLANG, *deps]
               if not wheel_tags(wheel_for(req, cache_target)) & here]
    download(foreign, cache_local, target=False)
    for requirement in foreign:
        wheel = wheel_for(requirement, cache_local, accept=lambda w: bool(wheel_tags(w) & here))
        if requirement == SGLANG:
            local_sglang = local / wheel.name
            slim_wheel.slim_wheel(wheel, local_sglang, slim_wheel.sglang_drop_rule(wheel))
            # The check installs this one; it must be the carried one's Python, byte for byte.
            if python_sources(local_sglang) != python_sources(wheels / source.name):
                raise SystemExit("the local and target slim sglang wheels differ in Python files")
        else:
            shutil.copy2(wheel, local)

    build_sgl_kvc(wheels)
    build_shims(wheels)

    manifest = {
        "target_python_tag": TARGET_TAG,
        "target_platforms": list(TARGET_PLATFORMS),
        "sglang_source_wheel": {"name": source.name, "size": source.stat().st_size,
                                "sha256": sha256(source)},
        "sglang_dropped_entries": len(result.dropped),
        "wheels": listing(wheels),
        local_name: listing(local),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = manifest["wheels"]["total_bytes"]
    print(f"kit: {len(manifest['wheels']['files'])} wheels, {total:,} bytes "
          f"({total / 2**20:.2f} MiB) in {wheels}; {local_name}: "
          f"{len(manifest[local_name]['files'])} wheels (local check only)")
    if total > limit_mib * 2**20:
        raise SystemExit(f"kit too large: {total / 2**20:.2f} MiB > {limit_mib} MiB")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-kit")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    args = parser.parse_args()
    build(args.out.resolve(), args.limit_mib)


if __name__ == "__main__":
    main()
