// Reduce: one launch sums several same-device arrays in source order and writes the result to several outputs.
//
// out_k[i] = (src_0[i] + src_1[i] + ... + src_{n-1}[i]) / divisor   for every output k
//
// Additions run in source order with the dtype's own rounding after each one, as NumPy's in-order adds do, so
// results match the CPU emulator bit for bit: float16 and bfloat16 are stored as 16-bit words, widened to float
// for each addition and rounded back (to nearest, ties to even); integers wrap. Only floats are divided (a mean);
// `divisor` 1 means a plain sum. Complex values are (re, im) pairs added part by part and divided as NumPy divides
// them (below). Booleans are reduced with max, because NumPy adds booleans as logical or.
// An output may be the first source (in-place scaling): each thread reads element i before writing it.
//
// The table holds n_src source pointers, then n_out output pointers. One thread per element, grid-stride.

#include "half.cuh"
#include "ieee.cuh"

__device__ __forceinline__ float bfloat16_to_float(unsigned short b) {
    return __uint_as_float((unsigned int)b << 16);
}

__device__ __forceinline__ unsigned short float_to_bfloat16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: the canonical quiet NaN, keeping the sign
        return (u & 0x80000000u) ? 0xffc0u : 0x7fc0u;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

template <typename T>
struct Native {  // float and double: the hardware's IEEE add and divide (ieee.cuh: subnormals kept)
    typedef T S;
    static const bool kFloat = true;
    static __device__ __forceinline__ S add(S a, S b) { return add_rn(a, b); }
    static __device__ __forceinline__ S divide(S a, int n) { return div_rn(a, (T)n); }
};

struct Half {
    typedef unsigned short S;
    static const bool kFloat = true;
    static __device__ __forceinline__ S add(S a, S b) {
        return float_to_half(add_rn(half_to_float(a), half_to_float(b)));
    }
    static __device__ __forceinline__ S divide(S a, int n) { return float_to_half(div_rn(half_to_float(a), (float)n)); }
};

struct BFloat16 {
    typedef unsigned short S;
    static const bool kFloat = true;
    static __device__ __forceinline__ S add(S a, S b) {
        return float_to_bfloat16(add_rn(bfloat16_to_float(a), bfloat16_to_float(b)));
    }
    static __device__ __forceinline__ S divide(S a, int n) {
        return float_to_bfloat16(div_rn(bfloat16_to_float(a), (float)n));
    }
};

// Aligned as a whole, for one wide load per element: every array handed to reduce_complex* must start on a
// 2 * sizeof(T) boundary (CuPy's allocations and packs of whole elements do; kernels.py checks it)
template <typename T>
struct alignas(2 * sizeof(T)) Pair {
    T re, im;
};

template <typename T>
struct Complex {  // complex64 / complex128
    typedef Pair<T> S;
    static const bool kFloat = true;
    static __device__ __forceinline__ S add(S a, S b) { return S{add_rn(a.re, b.re), add_rn(a.im, b.im)}; }
    // NumPy divides by a real n through complex division by (n, 0), Smith's method: ratio = 0 / n = 0 and
    // scale = 1 / n rounded once, so each part is (part +- other * ratio) * scale, not part / n. The _rn
    // operations (ieee.cuh) keep the compiler from fusing these into FMAs, whose single rounding would differ.
    static __device__ __forceinline__ S divide(S a, int n) {
        const T d = (T)n;
        const T ratio = div_rn((T)0, d);
        const T scale = div_rn((T)1, add_rn(d, mul_rn((T)0, ratio)));
        return S{mul_rn(add_rn(a.re, mul_rn(a.im, ratio)), scale),
                 mul_rn(sub_rn(a.im, mul_rn(a.re, ratio)), scale)};
    }
};

template <typename T, typename U>
struct Wrapping {  // integers: two's-complement wrap-around, computed in the unsigned type of the same width
    typedef T S;
    static const bool kFloat = false;
    static __device__ __forceinline__ S add(S a, S b) { return (S)((U)a + (U)b); }
};

struct Any {  // bool as bytes 0/1: or
    typedef unsigned char S;
    static const bool kFloat = false;
    static __device__ __forceinline__ S add(S a, S b) { return a > b ? a : b; }
};

template <typename Op>
__device__ void reduce(const long long* table, int n_src, int n_out, long long count, int divisor) {
    typedef typename Op::S S;
    const S* const* sources = reinterpret_cast<const S* const*>(table);
    S* const* outputs = reinterpret_cast<S* const*>(table + n_src);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        S total = sources[0][i];
        for (int k = 1; k < n_src; ++k) {
            total = Op::add(total, sources[k][i]);
        }
        if constexpr (Op::kFloat) {
            if (divisor != 1) {
                total = Op::divide(total, divisor);
            }
        }
        for (int k = 0; k < n_out; ++k) {
            outputs[k][i] = total;
        }
    }
}

#define DISTRIB_REDUCE_KERNEL(NAME, ...)                                                            \
    extern "C" __global__ void reduce_##NAME(const long long* table, int n_src, int n_out,          \
                                             long long count, int divisor) {                         \
        reduce<__VA_ARGS__>(table, n_src, n_out, count, divisor);                                    \
    }

DISTRIB_REDUCE_KERNEL(float16, Half)
DISTRIB_REDUCE_KERNEL(bfloat16, BFloat16)
DISTRIB_REDUCE_KERNEL(float32, Native<float>)
DISTRIB_REDUCE_KERNEL(float64, Native<double>)
DISTRIB_REDUCE_KERNEL(complex64, Complex<float>)
DISTRIB_REDUCE_KERNEL(complex128, Complex<double>)
DISTRIB_REDUCE_KERNEL(int8, Wrapping<signed char, unsigned char>)
DISTRIB_REDUCE_KERNEL(uint8, Wrapping<unsigned char, unsigned char>)
DISTRIB_REDUCE_KERNEL(int16, Wrapping<short, unsigned short>)
DISTRIB_REDUCE_KERNEL(uint16, Wrapping<unsigned short, unsigned short>)
DISTRIB_REDUCE_KERNEL(int32, Wrapping<int, unsigned int>)
DISTRIB_REDUCE_KERNEL(uint32, Wrapping<unsigned int, unsigned int>)
DISTRIB_REDUCE_KERNEL(int64, Wrapping<long long, unsigned long long>)
DISTRIB_REDUCE_KERNEL(uint64, Wrapping<unsigned long long, unsigned long long>)
DISTRIB_REDUCE_KERNEL(bool, Any)
