"""Routes keyed by where their token sits in the global batch, not by which rank runs it.

Shapes: T tokens, E experts, K top-k.

A token's key is a hash of ``(step, global token index, layer)``: the global index counts the
tokens of one optimizer step in global-batch order (sequence-major), so one process and every
data-parallel layout give each token the same key. Two things are built on it:

- :func:`skewed_topk`, the ``moe.routing=skewed`` selection: a seeded draw of K distinct experts
  per token from a Zipf-like preference, identical under every layout on the same global batch;
- :func:`route_checksum`, the record's ``routing_checksum``: a sum over routes of a hash of
  (token key, expert), so it does not depend on which rank routed which token, nor in which order.

Integer arithmetic only, in int64 without overflow: every hashed value is kept below 2**31, so
a product of two is below 2**62. Sums of route hashes are reduced modulo
:data:`CHECKSUM_MODULUS` (2**52: exact in a float64, and a sum over up to 2**11 ranks of values
below it stays within int64).
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK31 = (1 << 31) - 1
CHECKSUM_MODULUS = 1 << 52
# odd multipliers below 2**31 (the 31-bit murmur-style finaliser below) and salts that keep the
# draw and the checksum independent of each other
_MUL1, _MUL2, _MUL3 = 0x6B43A9B5, 0x2C1B3C6D, 0x297A2D39
_SALT_DRAW, _SALT_CHECKSUM = 0x1F3D5B79, 0x0B5AD4EB


def _mix(h: Tensor) -> Tensor:
    """A bijective, non-linear scramble of 31-bit values (xor-shifts and odd multiplies mod 2**31)."""
    h = h ^ (h >> 16)
    h = (h * _MUL1) & MASK31
    h = h ^ (h >> 15)
    h = (h * _MUL2) & MASK31
    return h ^ (h >> 16)


def _combine(h: Tensor, x: Tensor | int) -> Tensor:
    """Fold the value ``x`` into the hash ``h`` (both kept below 2**31)."""
    return _mix(((h * _MUL3) & MASK31) ^ (x & MASK31))


def token_keys(step: Tensor, token_T: Tensor, layer: Tensor | int) -> Tensor:
    """int64 ``[T]``: the key of each token (``token_T``: global token indices within ``step``)."""
    h = _combine(_mix(step.expand_as(token_T) & MASK31), token_T)
    h = _combine(h, token_T >> 31)
    # a tensor under compile (the router's layer_key): a Python int would be a symbolic size there,
    # which inductor's CPU code casts to float inside this integer hash
    return _combine(h, layer)


def skewed_topk(keys_T: Tensor, seed: Tensor, rotation_T: Tensor, num_experts: int, top_k: int,
                skew: float) -> Tensor:
    """int64 ``[T, K]`` distinct experts per token, drawn without replacement with probability
    proportional to ``(r + 1) ** -skew``, where ``r = (e - rotation) mod E`` is expert e's rank in
    the token's preference order (skew 0: uniform). Gumbel top-k on hashed uniforms, in float64 so
    ties are vanishingly rare."""
    experts_E = torch.arange(num_experts, device=keys_T.device)
    salted_T = _combine(keys_T, _combine(_mix(seed & MASK31), _SALT_DRAW))
    bits_TE = _combine(salted_T.unsqueeze(1), experts_E)
    uniform_TE = (bits_TE.double() + 0.5) / float(1 << 31)  # in (0, 1)
    gumbel_TE = -torch.log(-torch.log(uniform_TE))
    rank_TE = (experts_E - rotation_T.unsqueeze(1)) % num_experts
    scores_TE = gumbel_TE - skew * torch.log1p(rank_TE.double())
    return scores_TE.topk(top_k, dim=-1).indices


def route_checksum(keys_T: Tensor, idx_TK: Tensor) -> Tensor:
    """int64 scalar: the sum over routes of a hash of (token key, expert), modulo
    :data:`CHECKSUM_MODULUS` (each hash is below 2**31: the sum cannot overflow below 2**32 routes)."""
    salted_T = _combine(keys_T, _SALT_CHECKSUM)
    return _combine(salted_T.unsqueeze(1), idx_TK).sum() % CHECKSUM_MODULUS


def add_checksums(a: Tensor, b: Tensor) -> Tensor:
    """Two checksums combined (their sum modulo :data:`CHECKSUM_MODULUS`)."""
    return (a + b) % CHECKSUM_MODULUS
