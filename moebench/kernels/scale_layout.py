"""The blocked ("swizzled") scale layout of block-scaled GEMMs on SM100, and its grouped form.

Legend: R rows of scales (one per row of the matrix being scaled), B = K / 32 scale blocks per
row, N expert-sorted rows, E experts (groups).

SM100 tensor cores read MXFP8 scales in tiles of 128 rows x 4 blocks, each tile stored as 512
consecutive bytes in a 32 x 4 x 4 order (the cuBLAS "1D block scaling factors layout", also
what ``torch._scaled_grouped_mm`` expects): scale ``(i, j)`` of an ``[R, B]`` matrix lives at

    tile(i, j) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4),
    tile(i, j) = (i // 128) * ceil(B / 4) + j // 4

after padding R to a multiple of 128 and B to a multiple of 4 (padding holds zeros).

For a grouped GEMM whose row operand is split into ragged expert groups by ``offsets``, each
group's scales are laid out *on their own*: group g starts at scale row ``P_g``, the sum of the
earlier groups' sizes each rounded up to 128 (the kernel recomputes ``P_g`` from ``offsets``).
:func:`grouped_blocked` builds that on the device from the offsets, with no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moebench.kernels.groups import group_of_rows, group_sizes

TILE_ROWS = 128
TILE_BLOCKS = 4


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def blocked(scales_RB: Tensor) -> Tensor:
    """``[..., R, B]`` one-byte scales in the blocked layout, as contiguous ``[..., R_pad, B_pad]``.

    ``R_pad``/``B_pad`` round R and B up to 128 and 4; each trailing matrix's memory is in the
    tiled order above (its 2-D shape only carries the padded sizes). Leading dims are batched
    (one blocked matrix per expert).
    """
    *lead, rows, blocks = scales_RB.shape
    r_pad, b_pad = _round_up(rows, TILE_ROWS), _round_up(blocks, TILE_BLOCKS)
    # moved as raw bytes: not every device implements copies and fills for float8_e8m0fnu
    raw = scales_RB.view(torch.uint8)
    padded = raw.new_zeros(*lead, r_pad, b_pad)
    padded[..., :rows, :blocks] = raw
    # rows i = (tile, quarter, lane) with i % 128 = quarter * 32 + lane; blocks j = (col_tile, inner)
    tiles = padded.view(*lead, r_pad // TILE_ROWS, 4, 32, b_pad // TILE_BLOCKS, TILE_BLOCKS)
    n = len(lead)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.permute(order).contiguous().view(*lead, r_pad, b_pad).view(scales_RB.dtype)


def grouped_rows(offsets_E: Tensor, num_rows: int) -> tuple[Tensor, int]:
    """``(dest_N, rows)``: each row's scale row in the per-group 128-padded layout, and a static size.

    ``dest[i] = P_g + (i - start_g)`` for row i of group g. Rows past ``offsets[-1]`` (padding)
    go to the last row, which no group reaches: ``rows`` bounds ``sum_g round_up(size_g, 128)``
    (at most ``N + 127 E``) with one spare tile.
    """
    num_groups = offsets_E.numel()
    sizes = group_sizes(offsets_E)
    padded = (sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(sizes, 0) - sizes
    group = group_of_rows(offsets_E, num_rows)
    in_group = group < num_groups
    group = group.clamp(max=num_groups - 1)
    row = torch.arange(num_rows, device=offsets_E.device)
    rows = _round_up(num_rows, TILE_ROWS) + TILE_ROWS * (num_groups + 1)
    dest = torch.where(in_group, padded_start[group] + row - start[group], rows - 1)
    return dest, rows


def grouped_blocked(scales_NB: Tensor, offsets_E: Tensor) -> Tensor:
    """Blocked scales for a row operand split into groups by ``offsets_E`` (see module doc)."""
    num_rows, blocks = scales_NB.shape
    dest, rows = grouped_rows(offsets_E, num_rows)
    raw = scales_NB.view(torch.uint8)
    spread = raw.new_zeros(rows, blocks).index_copy_(0, dest, raw)  # padding rows all land on the spare row
    return blocked(spread.view(scales_NB.dtype))
