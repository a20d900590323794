// Pack and unpack: one launch moves every member of a pack between its own array and the flat buffer.
//
// Members are contiguous and are moved as raw words of W bytes (1, 2, 4, 8 or 16): the launcher picks the
// widest W that divides every pointer and every byte offset, so the dtype does not matter here. The table
// holds `count` member base pointers, then `count + 1` prefix sums of member sizes in words:
// member m owns flat words [offsets[m], offsets[m + 1]).
//
// Each block moves tiles of kWordsPerThread * blockDim.x consecutive words (grid-stride over tiles), thread t the
// words t, t + blockDim.x, ... of the tile, so loads and stores are coalesced whatever the member sizes are. Thread
// 0 finds the members of the tile's first and last words once (binary search, into shared memory); each thread then
// searches only between those two, after checking the member it found last. A tile inside one large member needs
// no search at all, and a tile of small members searches only among its own few, so 1,000 small members move at
// nearly the speed of 4 large ones (a grid-stride loop over single words searched all members for every word).

struct alignas(16) Word16 {  // aligned: one 128-bit load and store per word, not two 64-bit ones
    unsigned long long lo, hi;
};

#include "segments.cuh"

constexpr int kWordsPerThread = 8;  // WORDS_PER_THREAD in the kernel loader sizes the grid with the same number

template <typename W, bool kPack>
__device__ void move_words(W* flat, const long long* table, int count) {
    W* const* members = reinterpret_cast<W* const*>(table);
    const long long* offsets = table + count;
    const long long total = offsets[count];
    const long long tile = (long long)blockDim.x * kWordsPerThread;
    __shared__ int first, last;
    int m = 0;
    for (long long base = (long long)blockIdx.x * tile; base < total; base += (long long)gridDim.x * tile) {
        if (threadIdx.x == 0) {
            const long long end = base + tile < total ? base + tile : total;
            first = segment_of(offsets, count, base, m);
            last = segment_between(offsets, first, count, end - 1, first);
        }
        __syncthreads();
        const int lo = first, hi = last + 1;
        for (int k = 0; k < kWordsPerThread; ++k) {
            const long long i = base + threadIdx.x + (long long)k * blockDim.x;
            if (i >= total) {
                break;
            }
            m = segment_between(offsets, lo, hi, i, m);
            W* member = members[m] + (i - offsets[m]);
            if (kPack) {
                flat[i] = *member;
            } else {
                *member = flat[i];
            }
        }
        __syncthreads();  // every thread has read first and last before thread 0 writes the next tile's
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
