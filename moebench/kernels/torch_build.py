"""What the installed torch was built with, read from its files without importing it.

``moebench plan`` says when the torch where it runs would fall back to emulated quantized GEMMs,
but a plan imports no torch (seconds of import, and a plan must run where torch is not
installed). The torch package's ``version.py`` names its CUDA version, and its type stubs list
the ops it has, so both are read as text. Whether a CUDA build holds MSLK (the MXFP8 grouped GEMM)
is only in its compiled config: the trainer's check
(:func:`moebench.kernels.quantized.missing_kernel`) and probe say that at run time.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
from pathlib import Path

KERNEL_OPS = {"grouped": "_scaled_grouped_mm", "linear": "_scaled_mm"}  # the torch op each GEMM kind needs


@functools.cache
def _torch_dir() -> Path | None:
    """The installed torch package's folder (found, not imported); None without torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _version_fields(folder: Path) -> dict[str, object]:
    """The literal assignments of torch's ``version.py`` (``__version__``, ``cuda``, ...)."""
    try:
        tree = ast.parse((folder / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    fields: dict[str, object] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
            node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and node.value is not None:
            with contextlib.suppress(ValueError):  # a computed value: not a build fact
                fields[target.id] = ast.literal_eval(node.value)
    return fields


@functools.cache
def _has_op(folder: Path, op: str) -> bool | None:
    """Whether torch's op stubs define ``torch.<op>``; None where the stubs cannot be read."""
    try:
        stubs = (folder / "_C" / "_VariableFunctions.pyi").read_text()
    except OSError:
        return None
    return f"def {op}(" in stubs


def installed_kernel_gap(fmt: str, kind: str) -> str | None:
    """Why the torch installed here has no native ``fmt`` ``kind`` GEMM (not installed, not a CUDA
    build, no such op); None when its files show no gap. ``fmt`` is kept for the caller's
    signature: the format-specific MSLK check needs the compiled torch (see the module doc)."""
    folder = _torch_dir()
    if folder is None:
        return "torch is not installed here"
    fields = _version_fields(folder)
    version = fields.get("__version__", "(version unknown)")
    if "cuda" in fields and fields["cuda"] is None:
        return f"this torch {version} is not a CUDA build"
    op = KERNEL_OPS[kind]
    if _has_op(folder, op) is False:
        return f"this torch {version} has no torch.{op}"
    return None
