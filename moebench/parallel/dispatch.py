"""Expert-parallel dispatchers: move routed token rows to the ranks that own their experts.

Shapes: T tokens on this rank, K top-k, N = T*K routes, D model dim, E experts,
L = E / R local experts, R EP ranks, B rows per (source, destination) block, C rows one
destination receives at most.

Experts are owned in contiguous blocks (rank r holds experts r*L .. r*L+L-1), so routes
sorted by expert id are also grouped by destination rank.

- :class:`SyncAllToAll`: the standard path. Counts are exchanged, split sizes copied to
  the host (one device->host wait per MoE layer), an uneven all-to-all moves exactly the
  routed rows, and a local permute turns (source, expert) order into expert order.
- :class:`RowwiseDispatch`: GPU-resident routing. Per-expert counts are all-gathered on
  the device; every rank computes the same keep-matrix (``parallel.rowwise_capacity``, see
  :mod:`moebench.parallel.capacity`: one receive capacity ``C`` per destination shared by
  all sources, or the original per-pair one); each kept route gets its destination row in
  the receiver's expert-sorted buffer from device cumsums; routes over capacity are dropped
  (contribute zero) and counted. The transport is a fixed-size all-to-all of B-row blocks
  (the most one pair can keep, padding included), so no split size ever reaches the host.

Under ``torch.compile`` (``train.compile``) the row-wise dispatcher is traced: the count exchange
and the all-to-alls are functional collectives, counted as the forward is traced (a compiled
backward runs no Python, so the backward all-to-all is counted then too). Profiled steps and the
MXFP8 wire take the eager path (their clock and counters run in Python). The sync dispatcher
always runs eagerly between two graphs: its split sizes are host values.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from moebench.kernels import mxfp8
from moebench.kernels.routing import inverse_permutation, sort_routes, weighted_sum_routes
from moebench.model.moe import Dispatched
from moebench.model.phases import active_clock, profiling_clock
from moebench.model.router import in_recompute
from moebench.parallel.capacity import CAPACITY_RULES, block_rows, destination_capacity, keep_matrix
from moebench.parallel.comm import COUNTER, all_gather_functional, all_gather_single, count_in_backward


def _all_to_all(x: Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: dist.ProcessGroup,
                sent_rows: int, back_rows: int, wire: str | None = None,
                padding_rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Autograd all-to-all that records bytes sent now and in its backward.

    ``wire="mxfp8"`` sends MXFP8 rows (E4M3 elements + one E8M0 scale per 32) instead of
    ``x``'s dtype; the backward sends gradients in full precision (straight-through).
    ``padding_rows``: how many of the sent and of the back rows are empty slots (device scalars).
    """
    row_bytes = x.shape[1] * x.element_size()
    sent_pad, back_pad = padding_rows if padding_rows is not None else (None, None)
    if wire == "mxfp8":
        return _Mxfp8AllToAll.apply(x, out_splits, in_splits, group, sent_rows, back_rows, sent_pad, back_pad)
    COUNTER.add("ep", sent_rows * row_bytes)
    if sent_pad is not None:
        COUNTER.add_padding("ep", sent_pad * row_bytes)
    # under a clock, eager code times both directions as communication, each waited for at once
    # (where its first use would wait); a compiled graph keeps its functional collective, untimed
    if not torch.compiler.is_compiling() and active_clock() is not None:
        out = _ClockedAllToAll.apply(x, out_splits, in_splits, group)
    else:
        out = funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
    return count_in_backward(out, "ep", back_rows * row_bytes, None if back_pad is None else back_pad * row_bytes)


def _timed_all_to_all(x: Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                      group: dist.ProcessGroup) -> Tensor:
    """The functional all-to-all, waited for; under a clock its time counts as communication
    (``comm_s``) of the region it runs in (dispatch or combine)."""
    clock = active_clock()
    with clock.communication() if clock is not None else contextlib.nullcontext():
        return funcol.wait_tensor(funcol.all_to_all_single(x, out_splits, in_splits, group))


class _ClockedAllToAll(torch.autograd.Function):
    """The autograd all-to-all of clocked eager steps: each direction waited for and timed."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _timed_all_to_all(x_ND.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _timed_all_to_all(grad_ND.contiguous(), in_splits, out_splits, ctx.group), None, None, None


class _Mxfp8AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, sent_rows, back_rows, sent_pad, back_pad):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.back_rows, ctx.back_pad = (out_splits, in_splits), group, back_rows, back_pad
        packed = mxfp8.encode_rows(x_ND)
        COUNTER.add("ep", sent_rows * packed.shape[1])
        if sent_pad is not None:
            COUNTER.add_padding("ep", sent_pad * packed.shape[1])
        out = _timed_all_to_all(packed, out_splits, in_splits, group)
        return mxfp8.decode_rows(out, x_ND.shape[1], dtype=x_ND.dtype)

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        row_bytes = grad_ND.shape[1] * grad_ND.element_size()
        COUNTER.add("ep", ctx.back_rows * row_bytes)
        if ctx.back_pad is not None:
            COUNTER.add_padding("ep", ctx.back_pad * row_bytes)
        grad = _timed_all_to_all(grad_ND.contiguous(), in_splits, out_splits, ctx.group)
        return grad, None, None, None, None, None, None, None


class SyncAllToAll:
    fusable = False  # tokens cross ranks

    def __init__(self, group: dist.ProcessGroup, num_experts: int, wire: str | None = None) -> None:
        self.group = group
        self.wire = wire  # "mxfp8": quantized rows on the wire for the dispatch direction
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_experts = num_experts // self.size

    @torch.compiler.disable
    def dispatch(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched:
        R, L = self.size, self.local_experts
        order_N, counts_E, _ = sort_routes(idx_TK, num_experts)
        x_ND = x_TD.index_select(0, order_N // idx_TK.shape[1])
        recv_counts_E = torch.empty_like(counts_E)
        with COUNTER.on_axis("ep"):
            dist.all_to_all_single(recv_counts_E, counts_E, group=self.group)
        recv_RL = recv_counts_E.view(R, L)
        # The host copy below is this dispatcher's defining cost: the CPU waits for the GPU
        # (once: both split lists come back in one transfer).
        send_splits, recv_splits = torch.stack([counts_E.view(R, L).sum(1), recv_RL.sum(1)]).tolist()
        x_recv = _all_to_all(x_ND, recv_splits, send_splits, self.group,
                             sent_rows=sum(send_splits) - send_splits[self.rank],
                             back_rows=sum(recv_splits) - recv_splits[self.rank], wire=self.wire)
        perm = _source_to_expert_major(recv_RL, sum(recv_splits))
        offsets_L = recv_RL.sum(0).cumsum(0).to(torch.int32)
        state = (order_N, perm, send_splits, recv_splits)
        x_ND = x_recv.index_select(0, perm)
        # how many rows arrive is up to the routing: a compiled block takes them as a dynamic size
        # (one graph for every count) rather than recompiling for each new one
        torch._dynamo.maybe_mark_dynamic(x_ND, 0)
        return Dispatched(x_ND, offsets_L, state)

    @torch.compiler.disable
    def combine(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor:
        order_N, perm, send_splits, recv_splits = dispatched.state
        y_recv = y_ND.index_select(0, inverse_permutation(perm))
        y_sorted = _all_to_all(y_recv, send_splits, recv_splits, self.group,
                               sent_rows=sum(recv_splits) - recv_splits[self.rank],
                               back_rows=sum(send_splits) - send_splits[self.rank])
        return weighted_sum_routes(y_sorted.index_select(0, inverse_permutation(order_N)), weight_TK)


def _source_to_expert_major(counts_RL: Tensor, total: int) -> Tensor:
    """Row permutation from (source, expert)-ordered segments to (expert, source) order."""
    start_RL = (counts_RL.flatten().cumsum(0) - counts_RL.flatten()).view_as(counts_RL)
    seg_start, seg_len = start_RL.T.flatten(), counts_RL.T.flatten()
    out_start = seg_len.cumsum(0) - seg_len
    shift = torch.repeat_interleave(seg_start - out_start, seg_len, output_size=total)
    return torch.arange(total, device=counts_RL.device) + shift


class RowwiseDispatch:
    fusable = False  # tokens cross ranks

    def __init__(self, group: dist.ProcessGroup, num_experts: int, capacity_factor: float,
                 wire: str | None = None, rule: str = "destination") -> None:
        if rule not in CAPACITY_RULES:
            raise ValueError(f"parallel.rowwise_capacity={rule!r}: expected one of {', '.join(CAPACITY_RULES)}")
        self.group = group
        self.wire = wire
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_experts = num_experts // self.size
        self.capacity_factor = capacity_factor
        self.rule = rule
        self.stats = RowwiseStats(self.size)

    def capacity(self, num_routes: int) -> int:
        """Rows one destination receives at most, from all sources (from shapes only: no device value)."""
        return destination_capacity(self.capacity_factor, num_routes, self.size)

    def block_rows(self, num_routes: int) -> int:
        """Rows of each (source, destination) block on the wire, padding included."""
        return block_rows(self.rule, self.capacity_factor, num_routes, self.size)

    def _traced(self) -> bool:
        """Whether a compiled block traces this dispatcher: not in a profiled step (the profiling
        clock times each collective outside any graph; a step clock leaves the graph whole) nor with
        MXFP8 rows on the wire (its autograd function counts and times in Python, forward and backward)."""
        return profiling_clock() is None and self.wire is None

    def dispatch(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched:
        if self._traced():
            return self._dispatch(x_TD, idx_TK, num_experts)
        return self._dispatch_eager(x_TD, idx_TK, num_experts)

    def combine(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor:
        if self._traced():
            return self._combine(y_ND, weight_TK, dispatched)
        return self._combine_eager(y_ND, weight_TK, dispatched)

    @torch.compiler.disable
    def _dispatch_eager(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched:
        return self._dispatch(x_TD, idx_TK, num_experts)

    @torch.compiler.disable
    def _combine_eager(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor:
        return self._combine(y_ND, weight_TK, dispatched)

    def _gather_counts(self, counts_E: Tensor) -> Tensor:
        """``[R * E]``: every rank's routes per expert."""
        if torch.compiler.is_compiling() or active_clock() is None:
            return all_gather_functional(counts_E, self.group, "ep")
        counts_RE = counts_E.new_empty(self.size * counts_E.numel())
        with COUNTER.on_axis("ep"):  # the patched collective: timed as communication
            all_gather_single(counts_RE, counts_E, group=self.group)
        return counts_RE

    def _dispatch(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched:
        R, L, me = self.size, self.local_experts, self.rank
        num_tokens, top_k = idx_TK.shape
        N, B, C = num_tokens * top_k, self.block_rows(idx_TK.numel()), self.capacity(idx_TK.numel())
        dev = x_TD.device
        order_N, counts_E, _ = sort_routes(idx_TK, num_experts)

        counts_SDL = self._gather_counts(counts_E).view(R, R, L)  # [source, destination, local expert]
        # keep-matrix, identical on every rank (moebench.parallel.capacity); within a (source,
        # expert) the kept routes are the first ones by token position
        kept_SDL = keep_matrix(self.rule, counts_SDL, self.capacity_factor, N)
        dropped = (counts_SDL[me] - kept_SDL[me]).sum()
        if not in_recompute():
            self.stats.add(kept_SDL, C, B)
        # rows this rank sends to / receives from the other ranks that carry a route
        own = kept_SDL[me, me].sum()
        pad_sent, pad_recv = (R - 1) * B - (kept_SDL[me].sum() - own), (R - 1) * B - (kept_SDL[:, me].sum() - own)

        # send side: slot p of the block for destination d holds, expert by expert, the first
        # kept_SDL[me, d, l] routes of each local expert l of d
        slot_B = torch.arange(B, device=dev)
        send_DL = kept_SDL[me]
        route_start_DL = _exclusive_cumsum(counts_E, 0).view(R, L)  # first sorted route of each expert
        slot_route_DB = _slot_rows(send_DL, route_start_DL, slot_B, trash=N)
        # one gather straight from the tokens (empty slots -> appended zero row T), rather than
        # materialising the [N, D] expert-sorted copy first
        token_of_route = torch.cat([order_N // top_k, order_N.new_full((1,), num_tokens)])
        send_RB_D = _pad_row(x_TD).index_select(0, token_of_route[slot_route_DB.flatten()])
        recv_RB_D = _all_to_all(send_RB_D, None, None, self.group, sent_rows=(R - 1) * B, back_rows=(R - 1) * B,
                                wire=self.wire, padding_rows=(pad_sent, pad_recv))

        # receive side: recv slot (s, p) -> row of the expert-sorted buffer (C rows: expert l's
        # rows from every source, source by source)
        kept_SL = kept_SDL[:, me]  # what each source sent me, per local expert
        per_expert_L = kept_SL.sum(0)
        row_start_SL = (_exclusive_cumsum(per_expert_L, 0) + _exclusive_cumsum(kept_SL, 0))
        row_SB = _slot_rows(kept_SL, row_start_SL, slot_B, trash=C)  # padding slots -> trash row C
        src_of_row = torch.full((C + 1,), R * B, dtype=torch.int64, device=dev)
        src_of_row.scatter_(0, row_SB.flatten(), torch.arange(R * B, device=dev))
        x_buffer = _pad_row(recv_RB_D).index_select(0, src_of_row[:C])
        offsets_L = per_expert_L.cumsum(0).to(torch.int32)
        return Dispatched(x_buffer, offsets_L, (order_N, slot_route_DB, row_SB, pad_sent, pad_recv), dropped.float())

    def _combine(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor:
        order_N, slot_route_DB, row_SB, pad_sent, pad_recv = dispatched.state
        R, B = slot_route_DB.shape
        N = order_N.numel()
        # rows past offsets[-1] are never read: padding slots map to the appended zero row
        y_recv = _pad_row(y_ND).index_select(0, row_SB.flatten())
        y_back = _all_to_all(y_recv, None, None, self.group, sent_rows=(R - 1) * B, back_rows=(R - 1) * B,
                             padding_rows=(pad_recv, pad_sent))
        route_slot = torch.full((N + 1,), R * B, dtype=torch.int64, device=y_ND.device)
        route_slot.scatter_(0, slot_route_DB.flatten(), torch.arange(R * B, device=y_ND.device))
        # token-major route r is sorted route inv[r]; dropped routes -> the appended zero row
        y_routes = _pad_row(y_back).index_select(0, route_slot[:N][inverse_permutation(order_N)])
        return weighted_sum_routes(y_routes, weight_TK)


class RowwiseStats:
    """One layer's row-wise dispatch statistics over an optimizer step's micro-batches, on the
    device (identical on every rank of the EP group: they come from the shared keep matrix).

    ``take()`` returns ``[rank load max/mean, capacity use max, padding slots, slots]`` and
    starts the next step: rank load is the rows each EP rank received over the step, max over
    mean; capacity use the largest share of a destination's capacity one dispatch filled;
    slots are those of every (source, destination) block of the all-to-all, the ranks' own
    included.
    """

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.recv_D: Tensor | None = None
        self.util: Tensor | None = None
        self.kept: Tensor | None = None
        self.slots = 0

    def add(self, kept_SDL: Tensor, capacity: int, block_rows: int) -> None:
        recv_D = kept_SDL.sum((0, 2)).double()
        util = recv_D.max() / capacity
        if self.recv_D is None:
            self.recv_D, self.util, self.kept = recv_D, util, recv_D.sum()
        else:
            self.recv_D, self.util, self.kept = self.recv_D + recv_D, self.util.maximum(util), self.kept + recv_D.sum()
        self.slots += self.ranks * self.ranks * block_rows

    def take(self) -> Tensor | None:
        if self.recv_D is None:
            return None
        load = self.recv_D.max() / self.recv_D.mean().clamp_min(1e-9)
        out = torch.stack([load, self.util, self.slots - self.kept, torch.full_like(self.kept, self.slots)])
        self.recv_D = self.util = self.kept = None
        self.slots = 0
        return out


def _slot_rows(kept_XL: Tensor, start_XL: Tensor, slot_B: Tensor, trash: int) -> Tensor:
    """``[X, B]``: block x's slot p holds, expert by expert, row ``start_XL[x, l] + i`` for
    ``i < kept_XL[x, l]``; slots past the block's kept rows get ``trash``."""
    X, L = kept_XL.shape
    cum_XL = kept_XL.cumsum(-1)
    slot_XB = slot_B.expand(X, -1).contiguous()
    e_XB = torch.searchsorted(cum_XL, slot_XB, right=True)
    e_clamped_XB = e_XB.clamp(max=L - 1)
    row_XB = start_XL.gather(1, e_clamped_XB) + slot_XB - (cum_XL - kept_XL).gather(1, e_clamped_XB)
    return torch.where(e_XB < L, row_XB, trash)


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return x.cumsum(dim) - x


def _pad_row(x_ND: Tensor) -> Tensor:
    """Append one zero row (index N): the target of empty slots and dropped routes."""
    return torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[1])])
