// The segment of a flat index: offsets[k] <= i < offsets[k + 1], found by binary search after checking the
// caller's guess (the segment it found last, which neighbouring indices usually share).
// Inlined into the kernels that include it by the kernel loader's source().

// Searches segments lo..hi-1 only; the caller knows offsets[lo] <= i < offsets[hi]. Empty segments are skipped.
__device__ __forceinline__ int segment_between(const long long* offsets, int lo, int hi, long long i, int guess) {
    if (lo <= guess && guess < hi && offsets[guess] <= i && i < offsets[guess + 1]) {
        return guess;
    }
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

__device__ __forceinline__ int segment_of(const long long* offsets, int count, long long i, int guess) {
    return segment_between(offsets, 0, count, i, guess);
}
