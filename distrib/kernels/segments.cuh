// The segment of a flat index: offsets[k] <= i < offsets[k + 1], found by binary search after checking the
// caller's guess (the segment it found last, which neighbouring indices of a grid-stride loop usually share).
// Inlined into the kernels that include it by backends/cuda_kernels.py's source().

__device__ __forceinline__ int segment_of(const long long* offsets, int count, long long i, int guess) {
    if (offsets[guess] <= i && i < offsets[guess + 1]) {
        return guess;
    }
    int lo = 0, hi = count;  // offsets[lo] <= i < offsets[hi]; empty segments are skipped over
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (offsets[mid] <= i) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}
