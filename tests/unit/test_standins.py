"""The import stand-ins: last resort on the import path, harmless to import, loud when called."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest

from sgl_kvc.compat import standins


def _run(code: str, env_extra: dict[str, str] | None = None) -> dict:
    import os

    env = {**os.environ, **(env_extra or {})}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_standin_module_imports_and_raises_when_called(tmp_path) -> None:
    log = tmp_path / "log"
    result = _run(
        """
        import json, sys
        from sgl_kvc.compat import standins
        standins.install()
        import sgl_kernel
        from sgl_kernel.flash_attn import flash_attn_varlen_func
        from torchvision.transforms import InterpolationMode
        mode = InterpolationMode.BICUBIC  # attribute chains are fine
        try:
            flash_attn_varlen_func(1, 2)
            raised = False
        except standins.StandInCalled:
            raised = True
        print(json.dumps({"standin": standins.is_standin(sgl_kernel), "raised": raised,
                          "last": sys.meta_path[-1].__class__.__name__}))
        """,
        {"SGLKVC_STANDIN_LOG": str(log)},
    )
    assert result == {"standin": True, "raised": True, "last": "_StandInFinder"}
    events = log.read_text().splitlines()
    assert any(e.startswith("import sgl_kernel ") for e in events)
    assert any(e.startswith("call sgl_kernel.flash_attn.flash_attn_varlen_func ") for e in events)


def test_a_standin_module_has_only_what_is_imported_from_it() -> None:
    """Feature probes (`hasattr`, `getattr(..., None)`) see a stand-in module as having nothing:
    only `from module import name` gets a stand-in object."""
    result = _run(
        """
        import json
        from sgl_kvc.compat import standins
        standins.install()
        import sgl_kernel
        from sgl_kernel import silu_and_mul
        print(json.dumps({"hasattr": hasattr(sgl_kernel, "fused_add_rmsnorm"),
                          "getattr": getattr(sgl_kernel, "weak_ref_tensor", None) is None,
                          "imported": repr(silu_and_mul)}))
        """
    )
    assert result == {"hasattr": False, "getattr": True, "imported": "<stand-in sgl_kernel.silu_and_mul>"}


def test_on_a_gpu_machine_a_missing_sgl_kernel_fails_with_the_install_hint(monkeypatch) -> None:
    monkeypatch.setattr(standins, "_gpu_present", lambda: True)
    sys.modules.pop("sgl_kernel", None)
    standins.install()
    with pytest.raises(ImportError, match="install the GPU build"):
        importlib.import_module("sgl_kernel")
    assert "sgl_kernel" not in sys.modules


def test_real_package_wins_over_standin(tmp_path) -> None:
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    result = _run(
        f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from sgl_kvc.compat import standins
        standins.install()
        import sgl_kernel
        print(json.dumps({{"real": getattr(sgl_kernel, "REAL", False),
                           "standin": standins.is_standin(sgl_kernel)}}))
        """
    )
    assert result == {"real": True, "standin": False}


def test_unrelated_missing_module_still_fails() -> None:
    standins.install()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("definitely_not_a_module_sgl_kvc")


def test_install_is_idempotent() -> None:
    standins.install()
    standins.install()
    assert sum(isinstance(f, standins._StandInFinder) for f in sys.meta_path) == 1
