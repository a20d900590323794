"""pack.cu's tiled member search, emulated in Python: every word of every tile finds its member."""

from __future__ import annotations

import re

import numpy as np
import pytest

from distrib.backends.cuda import kernels as cuda_kernels


def segment_between(offsets, lo, hi, i, guess):
    """segments.cuh's search: offsets[lo] <= i < offsets[hi] is known; the guess is checked first."""
    if lo <= guess < hi and offsets[guess] <= i < offsets[guess + 1]:
        return guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= i:
            lo = mid
        else:
            hi = mid
    return lo


def emulate_tiles(offsets: list[int], block: int, blocks: int, per_thread: int) -> dict[int, int]:
    """The member move_words picks for every word, running its loops thread by thread."""
    count, total = len(offsets) - 1, offsets[-1]
    tile = block * per_thread
    picked = {}
    for b in range(blocks):
        last_seen = [0] * block  # each thread's `m`, kept across its tiles
        for base in range(b * tile, total, blocks * tile):
            first = segment_between(offsets, 0, count, base, last_seen[0])
            last = segment_between(offsets, first, count, min(base + tile, total) - 1, first)
            for t in range(block):
                for k in range(per_thread):
                    i = base + t + k * block
                    if i >= total:
                        break
                    last_seen[t] = segment_between(offsets, first, last + 1, i, last_seen[t])
                    picked[i] = last_seen[t]
    return picked


@pytest.mark.parametrize("sizes", [[1], [5, 0, 3], [1000, 1, 257, 4096], [3] * 300, [0, 0, 70, 0], [2048] * 5])
@pytest.mark.parametrize("blocks", [1, 3])
def test_every_word_finds_the_member_that_owns_it(sizes, blocks):
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    picked = emulate_tiles(offsets, block=32, blocks=blocks, per_thread=4)
    assert sorted(picked) == list(range(offsets[-1]))  # every word moved exactly once
    for word, member in picked.items():
        assert offsets[member] <= word < offsets[member + 1]


def test_the_launcher_sizes_the_grid_with_the_kernels_tile():
    source = cuda_kernels.source("pack.cu")
    (per_thread,) = re.findall(r"constexpr int kWordsPerThread = (\d+);", source)
    assert int(per_thread) == cuda_kernels.WORDS_PER_THREAD
