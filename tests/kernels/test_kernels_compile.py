"""Ahead-of-time compile of every Triton kernel for Hopper (SM90), on a machine without a GPU.

The interpreter tests check numerics but not that the kernels lower to GPU code; this does,
with triton's bundled ptxas. The pointer/stride divisibility hints mirror what Triton's JIT
specializes at launch for 16-byte aligned torch tensors. The GEMMs must use Hopper's
asynchronous tensor-core MMA (``wgmma``) and a software-pipelined K loop (``cp.async``).
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("ahead-of-time compile is not available under TRITON_INTERPRET=1", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moebench.kernels import fp8_group_triton, fp8_triton, grouped_gemm, mxfp8_triton, permute  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


def _compile(fn, signature: dict[str, str], constants: dict, num_warps: int = 8, num_stages: int = 3):
    sig = {name: signature.get(name, "constexpr" if name in constants else "i32") for name in fn.arg_names}
    hints = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name] != "constexpr" and (name.endswith("ptr") or name.startswith("stride") or name in ("N", "K"))}
    return triton.compile(ASTSource(fn, sig, constants, hints), target=SM90,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _ptrs(dtype: str, names: tuple[str, ...]) -> dict[str, str]:
    return {name: f"*{dtype}" for name in names}


MM = grouped_gemm._grouped_mm_kernel.fn.fn  # autotune -> heuristics -> jit
WGRAD = grouped_gemm._grouped_wgrad_kernel.fn


@pytest.mark.parametrize(("layout", "dtype", "even_k"), [("fwd", "bf16", True), ("dgrad", "bf16", True),
                                                        ("fwd", "fp32", False)])
def test_grouped_mm_compiles_to_pipelined_wgmma(layout: str, dtype: str, even_k: bool) -> None:
    sig = {**_ptrs(dtype, ("a_ptr", "b_ptr", "c_ptr")), "offs_ptr": "*i32"}
    unit_stride = {"stride_ak": 1, "stride_cn": 1, **({"stride_bn": 1} if layout == "fwd" else {"stride_bk": 1})}
    consts = {**unit_stride, "E_POW2": 64, "IEEE": dtype == "fp32", "EVEN_K": even_k,
              "BLOCK_M": 128, "BLOCK_N": 128 if dtype == "fp32" else 256, "BLOCK_K": 64}
    ptx = _compile(MM, sig, consts).asm["ptx"]
    if dtype == "bf16":
        assert "wgmma.mma_async" in ptx
        assert "cp.async" in ptx


def test_grouped_wgrad_compiles_to_pipelined_wgmma() -> None:
    sig = {**_ptrs("bf16", ("a_ptr", "g_ptr", "c_ptr")), "offs_ptr": "*i32"}
    consts = {"stride_ak": 1, "stride_gn": 1, "stride_cn": 1, "IEEE": False, "BLOCK_M": 128, "BLOCK_N": 128,
              "BLOCK_K": 64}
    ptx = _compile(WGRAD, sig, consts).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx


@pytest.mark.parametrize("bf16_bits", [True, False])
def test_mxfp8_kernel_compiles(bf16_bits: bool) -> None:
    sig = {"x_ptr": "*i16" if bf16_bits else "*fp32", "data_ptr": "*u8", "scale_ptr": "*u8"}
    _compile(mxfp8_triton._mxfp8_quantize_kernel, sig, {"ROUND_UP": True, "BF16_BITS": bf16_bits, "BLOCK_G": 64},
             num_warps=4, num_stages=1)


@pytest.mark.parametrize(("bf16_bits", "one_chunk"), [(True, True), (False, False)])
def test_fp8_rowwise_kernel_compiles(bf16_bits: bool, one_chunk: bool) -> None:
    sig = {"x_ptr": "*i16" if bf16_bits else "*fp32", "data_ptr": "*u8", "scale_bits_ptr": "*i32"}
    consts = {"BF16_BITS": bf16_bits, "BLOCK_R": 1, "BLOCK_K": 4096, "ONE_CHUNK": one_chunk}
    _compile(fp8_triton._fp8_rowwise_kernel, sig, consts, num_warps=8, num_stages=1)


@pytest.mark.parametrize("bf16_bits", [True, False])
def test_fp8_group_columns_kernels_compile(bf16_bits: bool) -> None:
    x = {"x_ptr": "*i16" if bf16_bits else "*fp32", "offs_ptr": "*i32", "scale_bits_ptr": "*i32"}
    _compile(fp8_group_triton._group_amax_kernel, x,
             {"BF16_BITS": bf16_bits, "BLOCK_R": fp8_group_triton._AMAX_BLOCK_R,
              "BLOCK_K": fp8_group_triton._AMAX_BLOCK_K}, num_warps=fp8_group_triton._NUM_WARPS, num_stages=1)
    _compile(fp8_group_triton._group_cast_t_kernel, {**x, "data_t_ptr": "*u8"},
             {"E_POW2": 64, "BF16_BITS": bf16_bits, "BLOCK_R": fp8_group_triton._CAST_BLOCK_R,
              "BLOCK_K": fp8_group_triton._CAST_BLOCK_K}, num_warps=fp8_group_triton._NUM_WARPS, num_stages=1)


@pytest.mark.parametrize("kernel", [permute._scatter_rows_kernel, permute._gather_rows_kernel])
def test_permute_kernels_compile(kernel) -> None:
    rows = ("x_ptr", "out_ptr") if kernel is permute._scatter_rows_kernel else ("y_ptr", "out_ptr")
    sig = {**_ptrs("bf16", rows), "dest_ptr": "*i64", "w_ptr": "*fp32"}
    _compile(kernel, sig, {"TOP_K": 8, "HAS_W": True, "BLOCK_D": 128}, num_warps=4, num_stages=1)
