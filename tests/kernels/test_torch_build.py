"""The installed torch's build facts read from its files (``moebench plan`` imports no torch)."""

from __future__ import annotations

import importlib.machinery

import pytest

from moebench.kernels import torch_build


@pytest.fixture(autouse=True)
def _fresh_caches():
    caches = (torch_build._torch_dir, torch_build._version_fields, torch_build._has_op)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def _fake_torch(tmp_path, monkeypatch, version_py: str | None, stubs: str | None) -> None:
    folder = tmp_path / "torch"
    (folder / "_C").mkdir(parents=True)
    if version_py is not None:
        (folder / "version.py").write_text(version_py)
    if stubs is not None:
        (folder / "_C" / "_VariableFunctions.pyi").write_text(stubs)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    monkeypatch.setattr(torch_build.importlib.util, "find_spec", lambda name: spec)


CPU = "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n"
CUDA = "__version__ = '2.13.0+cu130'\ncuda: Optional[str] = '13.0'\n"


@pytest.mark.parametrize(("version_py", "stubs", "kind", "gap"), [
    (CPU, "def _scaled_mm(\n", "linear", "this torch 2.13.0+cpu is not a CUDA build"),
    (CUDA, "def _scaled_mm(\n", "grouped", "this torch 2.13.0+cu130 has no torch._scaled_grouped_mm"),
    (CUDA, "def _scaled_mm(\ndef _scaled_grouped_mm(\n", "grouped", None),
    (CUDA, None, "grouped", None),  # no stubs: no gap claimed, the trainer's probe decides
])
def test_gaps_are_read_from_the_files(tmp_path, monkeypatch, version_py, stubs, kind, gap):
    _fake_torch(tmp_path, monkeypatch, version_py, stubs)
    assert torch_build.installed_kernel_gap("fp8", kind) == gap


def test_without_torch_the_gap_says_so(monkeypatch):
    monkeypatch.setattr(torch_build.importlib.util, "find_spec", lambda name: None)
    assert torch_build.installed_kernel_gap("mxfp8", "grouped") == "torch is not installed here"


@pytest.mark.parametrize("kind", ["grouped", "linear"])
def test_the_files_agree_with_the_imported_torch(kind):
    """On this machine the text reading says what the trainer's check (torch imported) says."""
    from moebench.kernels.quantized import missing_kernel

    assert torch_build.installed_kernel_gap("fp8", kind) == missing_kernel("fp8", kind)
