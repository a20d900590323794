// Pack and unpack: one launch moves every member of a pack between its own array and the flat buffer.
//
// Members are contiguous and are moved as raw words of W bytes (1, 2, 4, 8 or 16): the launcher picks the
// widest W that divides every pointer and every byte offset, so the dtype does not matter here. The table
// holds `count` member base pointers, then `count + 1` prefix sums of member sizes in words:
// member m owns flat words [offsets[m], offsets[m + 1]).
//
// One thread per word, grid-stride: consecutive threads touch consecutive words, so loads and stores are
// coalesced within a member whatever the member sizes are (a block per member would idle on small members
// and serialise big ones). A thread finds its member by binary search over the offsets, after first
// checking the member it found last, which is the answer for every word but the first in big members.

struct Word16 {
    unsigned long long lo, hi;
};

#include "segments.cuh"

template <typename W, bool kPack>
__device__ void move_words(W* flat, const long long* table, int count) {
    W* const* members = reinterpret_cast<W* const*>(table);
    const long long* offsets = table + count;
    const long long total = offsets[count];
    const long long stride = (long long)gridDim.x * blockDim.x;
    int m = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        m = segment_of(offsets, count, i, m);
        W* member = members[m] + (i - offsets[m]);
        if (kPack) {
            flat[i] = *member;
        } else {
            *member = flat[i];
        }
    }
}

#define DISTRIB_MOVE_KERNELS(W, SUFFIX)                                                    \
    extern "C" __global__ void pack_##SUFFIX(W* flat, const long long* table, int count) {   \
        move_words<W, true>(flat, table, count);                                               \
    }                                                                                          \
    extern "C" __global__ void unpack_##SUFFIX(W* flat, const long long* table, int count) { \
        move_words<W, false>(flat, table, count);                                              \
    }

DISTRIB_MOVE_KERNELS(unsigned char, w1)
DISTRIB_MOVE_KERNELS(unsigned short, w2)
DISTRIB_MOVE_KERNELS(unsigned int, w4)
DISTRIB_MOVE_KERNELS(unsigned long long, w8)
DISTRIB_MOVE_KERNELS(Word16, w16)
