"""The offline GPU kit's pieces (gpu/): the sgl_kernel stub, the post-import patches, the
reproducible wheel slimming and the install plan. Fast: no download, no GPU, no SGLang import.
`gpu/` is not an installed package, so its modules are loaded from their files."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "gpu"
SHIMS = GPU / "shims"


def _load(name: str, path: Path) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


slim_wheel = _load("slim_wheel", GPU / "slim_wheel.py")
build_kit = _load("gpu_build_kit", GPU / "build_kit.py")
install_plan = _load("gpu_install_plan", GPU / "install_plan.py")
shims = _load("gpu_kit_shims", SHIMS / "sgl_kvc_gpu_shims.py")


def _run_with_shims_on_path(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter with gpu/shims first on the path (the test venv has
    sgl_kvc's own CPU stand-in for sgl_kernel, which the real files must win over)."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(SHIMS), **env}, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the sgl_kernel stub ----------------------------------------------------------------------

def test_stub_imports_any_name_and_raises_when_called() -> None:
    result = _run_with_shims_on_path("""
        import json
        # sgl_kvc.launch installs sgl_kvc's CPU stand-ins, which refuse sgl_kernel on a GPU
        # machine: the stub's names must not reach them (a GPU is faked for that).
        from sgl_kvc.compat import standins
        standins._gpu_present = lambda: True
        standins.install()
        import sgl_kernel
        from sgl_kernel import fused_add_rmsnorm, utils
        from sgl_kernel.kvcacheio import transfer_kv_all_layer
        from sgl_kernel.quantization import ggml_dequantize
        from sgl_kernel.flash_attn import flash_attn_varlen_func  # no file: the finder serves it
        from sgl_kernel.utils import is_arch_support_pdl
        import sgl_kernel.allreduce
        try:
            fused_add_rmsnorm(1, 2)
            raised = None
        except RuntimeError as e:
            raised = [type(e).__name__, str(e)]
        try:
            from sgl_kernel.scalar_type import ScalarType
            scalar_type = "imported"
        except ImportError:
            scalar_type = "ImportError"
        print(json.dumps({
            "file": sgl_kernel.__file__, "version": sgl_kernel.__version__,
            "utils_is_module": type(utils).__name__ == "module",
            "pdl": is_arch_support_pdl(), "raised": raised, "scalar_type": scalar_type,
            "names": [repr(transfer_kv_all_layer), repr(ggml_dequantize),
                      repr(flash_attn_varlen_func), repr(sgl_kernel.allreduce.x)],
            "dunder": hasattr(sgl_kernel, "__wrapped__"),
        }))
    """)
    assert result["file"].startswith(str(SHIMS))
    assert result["version"].startswith("0.0.0+")
    assert result["utils_is_module"] and result["pdl"] is False
    assert result["raised"][0] == "SglKernelStubCalled"
    assert "sgl_kernel.fused_add_rmsnorm" in result["raised"][1]
    assert "SGLANG_FORCE_FUSED_OP_BACKEND=torch" in result["raised"][1]
    assert result["scalar_type"] == "ImportError"  # SGLang's quantization utils then use mocks
    assert all("sgl_kernel stub" in name for name in result["names"])
    assert result["dunder"] is False


# --- the post-import patches ------------------------------------------------------------------

FAKE_DUAL_GEMM = """
class DualGemm:
    def _select_mode(self, gate_up_proj, hidden_size):
        raise ImportError("cutlass")  # what the real one does without nvidia-cutlass-dsl
"""
FAKE_MEMORY_POOL = """
def can_use_store_cache(row_bytes, v_row_bytes=None):
    return True

def store(row_bytes):  # looks the global up at call time, as _set_kv_buffer_impl does
    return can_use_store_cache(row_bytes, row_bytes)
"""


@pytest.fixture
def fake_sglang_modules(tmp_path, monkeypatch):
    """Stand-ins for the two patched SGLang modules, under names of their own."""
    (tmp_path / "kitfake_dual_gemm.py").write_text(FAKE_DUAL_GEMM)
    (tmp_path / "kitfake_memory_pool.py").write_text(FAKE_MEMORY_POOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield {"kitfake_dual_gemm": shims.patch_dual_gemm,
           "kitfake_memory_pool": shims.patch_memory_pool}
    for name in ("kitfake_dual_gemm", "kitfake_memory_pool"):
        sys.modules.pop(name, None)


def test_post_import_hook_patches_after_the_module_ran(fake_sglang_modules, monkeypatch) -> None:
    monkeypatch.delenv(shims.ENV, raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    hook = shims.install(fake_sglang_modules)
    assert hook is sys.meta_path[0]
    import kitfake_dual_gemm
    import kitfake_memory_pool

    assert kitfake_dual_gemm.DualGemm()._select_mode(None, 4096) is None
    assert kitfake_memory_pool.can_use_store_cache(256) is False
    assert kitfake_memory_pool.store(256) is False
    assert kitfake_memory_pool.__spec__.origin.endswith("kitfake_memory_pool.py")


def test_hook_inactive_when_disabled(fake_sglang_modules, monkeypatch) -> None:
    monkeypatch.setenv(shims.ENV, "0")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert shims.install(fake_sglang_modules) is None
    import kitfake_memory_pool

    assert kitfake_memory_pool.can_use_store_cache(256) is True


def test_patches_name_what_sglang_0_5_23_looks_up() -> None:
    """The patched names exist in the installed SGLang source, and the KV store reads the
    module global (so replacing it on the module takes effect). Read as text: no SGLang import."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang is not installed")
    root = Path(spec.submodule_search_locations[0])
    assert set(shims.PATCHES) == {"sglang.srt.layers.dual_gemm",
                                  "sglang.srt.mem_cache.memory_pool"}
    dual_gemm = (root / "srt/layers/dual_gemm.py").read_text()
    pool = (root / "srt/mem_cache/memory_pool.py").read_text()
    assert "class DualGemm" in dual_gemm and "def _select_mode(" in dual_gemm
    assert "self.mode = self._select_mode(" in dual_gemm
    assert "import can_use_store_cache" in pool
    assert "and can_use_store_cache(row_bytes, v_row_bytes)" in pool


def test_pth_line_installs_the_hook_in_a_fresh_interpreter(tmp_path) -> None:
    for name in ("sgl_kvc_gpu_shims.pth", "sgl_kvc_gpu_shims.py"):
        (tmp_path / name).write_bytes((SHIMS / name).read_bytes())
    code = f"""
        import json, site, sys
        site.addsitedir({str(tmp_path)!r})
        print(json.dumps([type(f).__name__ for f in sys.meta_path]))
    """
    assert "PostImportHook" in _run_with_shims_on_path(code)
    assert "PostImportHook" not in _run_with_shims_on_path(code, SGLKVC_GPU_SHIMS="0")


# --- wheel slimming ---------------------------------------------------------------------------

def _synthetic_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo/__init__.py", "")
        z.writestr("demo/core.py", "x = 1\n")
        z.writestr("demo/configs/E=8,N=16,device_name=H100.json", "{}")  # a comma in a name
        z.writestr("demo/rust/_server.cpython-312-x86_64-linux-gnu.so", b"\x7fELF" + bytes(4096))
        z.writestr("demo/gen/diffusion.py", "y = 2\n")
        info = zipfile.ZipInfo("demo/bin/tool.sh")
        info.external_attr = 0o100755 << 16
        z.writestr(info, "#!/bin/sh\n")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
        z.writestr("demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        z.writestr("demo-1.0.dist-info/RECORD", "stale,,\n")
    return path


def _record_matches(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        rows = list(csv.reader(io.StringIO(z.read("demo-1.0.dist-info/RECORD").decode())))
        for name, digest, size in rows:
            if name.endswith("/RECORD"):
                assert digest == size == ""
                continue
            data = z.read(name)
            assert digest == slim_wheel.record_hash(data) and int(size) == len(data), name
    assert sorted(r[0] for r in rows) == sorted(names)
    return names


def test_slim_wheel_drops_rewrites_record_and_is_reproducible(tmp_path) -> None:
    src = _synthetic_wheel(tmp_path / "demo-1.0-py3-none-any.whl")
    rule = slim_wheel.pattern_rule((r"demo/rust/_(server|bench)\.[^/]*\.so", r"demo/gen/.*"))
    first = slim_wheel.slim_wheel(src, tmp_path / "a" / src.name, rule)
    second = slim_wheel.slim_wheel(src, tmp_path / "b" / src.name, rule)

    assert first.dropped == ["demo/gen/diffusion.py",
                             "demo/rust/_server.cpython-312-x86_64-linux-gnu.so"]
    names = _record_matches(tmp_path / "a" / src.name)
    assert not any(n.startswith(("demo/gen/", "demo/rust/")) for n in names)
    assert names[-1] == "demo-1.0.dist-info/RECORD"  # dist-info last, RECORD the very last
    assert (tmp_path / "a" / src.name).read_bytes() == (tmp_path / "b" / src.name).read_bytes()
    assert first == second
    with zipfile.ZipFile(tmp_path / "a" / src.name) as z:
        assert {i.date_time for i in z.infolist()} == {slim_wheel.ZIP_EPOCH}
        assert z.getinfo("demo/bin/tool.sh").external_attr >> 16 == 0o100755
        assert z.getinfo("demo/core.py").external_attr >> 16 == 0o100644


def test_unused_models_follow_module_level_imports_only() -> None:
    sources = {
        "sglang/launch_server.py": b"from sglang.srt.models import llama\n",
        "sglang/srt/models/__init__.py": b"",
        "sglang/srt/models/llama.py": (b"from .utils import helper\n"
                                       b"if _is_cuda:\n    from sglang.srt.models.cuda_only import k\n"
                                       b"def load():\n    from sglang.srt.models import big\n"),
        "sglang/srt/models/utils.py": b"",
        "sglang/srt/models/cuda_only.py": b"",
        "sglang/srt/models/big.py": b"import torch\n",
        "sglang/srt/models/family/__init__.py": b"",
        "sglang/srt/models/family/layers.py": b"",
    }
    reachable = slim_wheel.reachable_modules(sources, ["sglang.launch_server"])
    assert {"sglang.srt.models.llama", "sglang.srt.models.utils",
            "sglang.srt.models.cuda_only"} <= reachable
    assert slim_wheel.unused_model_files(sources, reachable) == {
        "sglang/srt/models/big.py", "sglang/srt/models/family/__init__.py",
        "sglang/srt/models/family/layers.py"}


def test_sglang_rule_refuses_to_drop_a_module_the_server_imports(tmp_path) -> None:
    wheel = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/__init__.py", "")
        z.writestr("sglang/launch_server.py", "import sglang.benchmark.one_batch\n")
        z.writestr("sglang/benchmark/__init__.py", "")
        z.writestr("sglang/benchmark/one_batch.py", "")
    with pytest.raises(RuntimeError, match="sglang/benchmark/"):
        slim_wheel.sglang_drop_rule(wheel)


# --- build and install helpers ----------------------------------------------------------------

def test_kit_dependencies_all_have_versions() -> None:
    reqs = build_kit.pinned_requirements(GPU / "kit-deps.txt", REPO / "requirements" / "cpu.txt")
    assert all("==" in r for r in reqs) and len(reqs) == len(set(reqs))
    assert "apache-tvm-ffi==0.1.11" in reqs


def test_pinned_requirements_take_versions_from_the_pins_file(tmp_path) -> None:
    (tmp_path / "deps").write_text("# c\nFoo_Bar\nbaz==2.0  # own pin\n")
    (tmp_path / "pins").write_text("foo-bar==1.5\n")
    assert build_kit.pinned_requirements(tmp_path / "deps", tmp_path / "pins") == [
        "Foo_Bar==1.5", "baz==2.0"]
    (tmp_path / "deps").write_text("missing\n")
    with pytest.raises(SystemExit, match="missing"):
        build_kit.pinned_requirements(tmp_path / "deps", tmp_path / "pins")


def test_install_plan_skips_same_or_newer_and_prefers_later_folders(tmp_path) -> None:
    kit, local = tmp_path / "wheels", tmp_path / "local"
    kit.mkdir()
    local.mkdir()
    for name in ("pytest-1.0-py3-none-any.whl",  # installed newer: never downgrade
                 "kitplan_absent_pkg-1.0-py3-none-any.whl",
                 "kitplan_native-1.0-cp27-cp27m-win32.whl",  # not installable here
                 "pluggy-999.0-py3-none-any.whl"):  # installed older: upgrade
        (kit / name).touch()
    (local / "kitplan_absent_pkg-1.0-py2.py3-none-any.whl").touch()
    todo, notes = install_plan.plan([kit, local])
    assert [w.name for w in todo] == ["kitplan_absent_pkg-1.0-py2.py3-none-any.whl",
                                      "pluggy-999.0-py3-none-any.whl"]
    assert any(n.startswith("skip pytest 1.0") for n in notes)
    assert any(n.startswith("upgrade pluggy") for n in notes)


def test_shims_wheel_puts_the_pth_at_the_root(tmp_path) -> None:
    wheel = build_kit.build_shims(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert {"sgl_kvc_gpu_shims.pth", "sgl_kvc_gpu_shims.py", "sgl_kernel/__init__.py",
            "sgl_kernel/utils.py"} <= set(names)
    assert build_kit.build_shims(tmp_path).read_bytes() == wheel.read_bytes()
