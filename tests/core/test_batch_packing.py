"""The batch-wide packer (core/packing/batch_packing.py): every row lands in one of its block's bins, ``fits`` tells the
truth, the swap repair never adds over-fill, and at users' sizes (blocks of thousands of rows, a few tokens of slack
a micro-batch) the planner's micro-batches reach the bound without any per-block search or verl's cut."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core import pack_micro_batches
from verl_traj.core.packing import bin_packing
from verl_traj.core.packing.batch_packing import MAX_EXTRA_BINS, BatchPacking, pack_blocks, pack_fewest


def _loads(sizes, counts, bins, assign):
    block = np.repeat(np.arange(counts.size), counts)
    offset = np.cumsum(bins) - bins
    return np.bincount(offset[block] + assign, weights=sizes, minlength=int(bins.sum())), np.repeat(
        np.arange(counts.size), bins)


def _blocks(seed: int, num_blocks: int, most_rows: int, cap: int):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, most_rows + 1, num_blocks)
    sizes = np.concatenate([np.sort(rng.integers(0, cap + 1, n))[::-1] for n in counts]).astype(np.int64)
    return sizes, np.cumsum(counts) - counts, counts


def _tight_block(rng: np.random.Generator, bins: int, cap: int, waste: int) -> np.ndarray:
    """Rows of agent-like lengths (300-1024 tokens) that fill ``bins`` bins to within ``waste`` tokens each."""
    rows = []
    for _ in range(bins):
        left = cap - int(rng.integers(0, waste + 1))
        while left > 1024:
            rows.append(int(rng.integers(300, 1025)))
            left -= rows[-1]
        rows += [left] if left > 0 else []
    return rng.permutation(np.asarray(rows, dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(0, 40), st.integers(1, 500),
       st.integers(0, 3), st.integers(0, 8))
def test_every_row_in_one_of_its_bins_and_fits_tells_the_truth(seed, num_blocks, most_rows, cap, extra, rounds):
    sizes, starts, counts = _blocks(seed, num_blocks, most_rows, cap)
    total = np.add.reduceat(np.concatenate([sizes, [0]]), np.minimum(starts, sizes.size))[:num_blocks]
    bins = np.where(counts > 0, np.maximum(1, -(-np.where(counts > 0, total, 0) // cap)) + extra, 0)
    out = pack_blocks(sizes, starts, counts, bins, cap, rounds=rounds)
    block = np.repeat(np.arange(num_blocks), counts)
    assert out.bin.shape == sizes.shape and (out.bin >= 0).all() and (out.bin < bins[block]).all()
    loads, bin_block = _loads(sizes, counts, bins, out.bin)
    fits = np.ones(num_blocks, dtype=bool)
    np.logical_and.at(fits, bin_block, loads <= cap)
    assert (out.fits == fits).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(0, 16))
def test_the_swap_repair_never_adds_over_fill(seed, num_blocks, waste):
    rng = np.random.default_rng(seed)
    blocks = [np.sort(_tight_block(rng, int(rng.integers(1, 12)), 4096, waste))[::-1] for _ in range(num_blocks)]
    sizes, counts = np.concatenate(blocks), np.array([b.size for b in blocks])
    starts, bins = np.cumsum(counts) - counts, np.array([-(-int(b.sum()) // 4096) for b in blocks])
    over = []
    for rounds in (0, 1, 4, 64):
        loads, _ = _loads(sizes, counts, bins, pack_blocks(sizes, starts, counts, bins, 4096, rounds=rounds).bin)
        over.append(np.maximum(loads - 4096, 0).sum())
    assert over == sorted(over, reverse=True)


def test_pack_fewest_adds_bins_only_to_blocks_too_large_to_search():
    """A block whose rows x bins exceed the search limit gets more bins batch-wide (here up to MAX_EXTRA_BINS, as
    the stub packer never fits); a smaller one stays at its bound for the caller's exact search."""
    sizes = np.concatenate([np.full(60, 90), np.full(5, 90)]).astype(np.int64)
    counts, starts = np.array([60, 5]), np.array([0, 60])

    def never_fits(sizes, starts, counts, bins, cap, **_):
        return BatchPacking(np.zeros(sizes.size, dtype=np.int64), np.zeros(counts.size, dtype=bool))

    with mock.patch("verl_traj.core.packing.batch_packing.pack_blocks", side_effect=never_fits) as packed:
        out, bins, _ = pack_fewest(sizes, starts, counts, 1000, search_limit=100)
    assert bins.tolist() == [6 + MAX_EXTRA_BINS, 1] and not out.fits.any()
    assert packed.call_count == 1 + MAX_EXTRA_BINS
    out, bins, _ = pack_fewest(sizes, starts, counts, 1000, search_limit=100)  # the real packer fits at the bound
    assert bins.tolist() == [6, 1] and out.fits.all()


def test_users_sizes_reach_the_bound_batch_wide():
    """64 blocks of 600-2,400 agent rows, each block within 16 tokens a micro-batch of its bound (the planner's
    rank balancing leaves about that): every block at the bound, found batch-wide -- neither the per-block
    search nor the caller's partitioner (verl's Karmarkar-Karp, O(rows x bins) Python objects) is called."""
    rng = np.random.default_rng(7)
    blocks = [_tight_block(rng, int(rng.integers(50, 200)), 8192, 16) for _ in range(64)]
    tokens = np.concatenate(blocks)
    block = np.repeat(np.arange(64), [b.size for b in blocks])
    calls = []
    with mock.patch.object(bin_packing, "pack_into", side_effect=AssertionError("per-block search")):
        p = pack_micro_batches(tokens, block, np.arange(64), 64, 8192,
                               partitioner=lambda s, k: calls.append(k) or [list(range(len(s)))])
    assert calls == []
    assert (p.block_count == p.block_lower_bound).all()
    assert (p.block_count == [-(-int(b.sum()) // 8192) for b in blocks]).all()
    loads = np.zeros((64, int(p.block_count.max())), dtype=np.int64)
    np.add.at(loads, (block, p.micro_index), tokens)
    assert loads.max() <= 8192


def test_a_cap_past_int32_packs_in_int64():
    """Token counts near 2^30 (the repair's int32 fast path would overflow): the same packing as the scaled-down rows."""
    rng = np.random.default_rng(3)
    rows = np.sort(_tight_block(rng, 6, 4096, 8))[::-1]
    counts, starts, bins = np.array([rows.size]), np.array([0]), np.array([6])
    small = pack_blocks(rows, starts, counts, bins, 4096)
    big = pack_blocks(rows * (1 << 20), starts, counts, bins, 4096 << 20)
    assert small.fits.all() and big.fits.all() and (small.bin == big.bin).all()
