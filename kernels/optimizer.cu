// Optimizer updates: one launch applies SGD (plain, momentum, Nesterov) or Adam to every tensor of a group.
//
// The math is distrib/optimizers.py's `_update_device`, operation by operation, so results match the NumPy path
// bit for bit: every operation is one IEEE operation rounded to nearest, subnormals kept (ieee.cuh's float
// operations and the double _rn intrinsics, which the compiler never contracts into fused multiply-adds), in the
// math type: float for float16 and float32 parameters, double for float64. Gradients and slots have the math
// type; a float16 parameter is widened to float, updated in float and rounded back to float16 (to nearest, ties
// to even), as NumPy's mixed-type subtract does.
//
// The table holds `count` parameter pointers, `count` gradient pointers, then the slots' pointers, `count` per
// slot in the optimizer's slot order (momentum; or m, v), then `count + 1` prefix sums of the tensors' sizes:
// tensor t owns elements [offsets[t], offsets[t + 1]). Each kernel takes its optimizer's `_coefficients` in order
// (plain SGD ignores its momentum).
//
// One thread per element, grid-stride; a thread finds its tensor by binary search over the offsets, after first
// checking the tensor it found last, as pack.cu does.

#include "half.cuh"
#include "ieee.cuh"

// A float or double whose operators each round once, as NumPy's element-wise operations do.
template <typename T>
struct Exact {
    T x;
};

// ieee.cuh's operations, overloaded for float and double
template <typename T>
__device__ __forceinline__ Exact<T> operator+(Exact<T> a, Exact<T> b) { return {add_rn(a.x, b.x)}; }
template <typename T>
__device__ __forceinline__ Exact<T> operator-(Exact<T> a, Exact<T> b) { return {sub_rn(a.x, b.x)}; }
template <typename T>
__device__ __forceinline__ Exact<T> operator*(Exact<T> a, Exact<T> b) { return {mul_rn(a.x, b.x)}; }
template <typename T>
__device__ __forceinline__ Exact<T> operator/(Exact<T> a, Exact<T> b) { return {div_rn(a.x, b.x)}; }
template <typename T>
__device__ __forceinline__ Exact<T> sqrt(Exact<T> a) { return {sqrt_rn(a.x)}; }

// Parameters in their storage type (float16 as its 16-bit word) to and from the math type.
__device__ __forceinline__ float widen(unsigned short h) { return half_to_float(h); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ void narrow(unsigned short* p, float x) { *p = float_to_half(x); }
__device__ __forceinline__ void narrow(float* p, float x) { *p = x; }
__device__ __forceinline__ void narrow(double* p, double x) { *p = x; }

// The rules: each updates one element's slots (pointers into them, `s`) and returns the new parameter value.

template <typename T>
struct Sgd {  // var -= lr * g
    static const int kSlots = 0;
    Exact<T> lr;
    __device__ Exact<T> operator()(Exact<T> var, Exact<T> g, T* const*) const { return var - lr * g; }
};

template <typename T, bool kNesterov>
struct Momentum {  // m = momentum * m - lr * g; var += m, or var += momentum * m - lr * g (Nesterov)
    static const int kSlots = 1;
    Exact<T> lr, momentum;
    __device__ Exact<T> operator()(Exact<T> var, Exact<T> g, T* const* s) const {
        Exact<T> m = momentum * Exact<T>{*s[0]} - lr * g;
        *s[0] = m.x;
        return kNesterov ? var + (momentum * m - lr * g) : var + m;
    }
};

template <typename T>
struct Adam {  // m += (g - m) * (1 - beta_1); v += (g * g - v) * (1 - beta_2); var -= m * lr_t / (sqrt(v) + epsilon)
    static const int kSlots = 2;
    Exact<T> lr_t, one_minus_beta_1, one_minus_beta_2, epsilon;
    __device__ Exact<T> operator()(Exact<T> var, Exact<T> g, T* const* s) const {
        Exact<T> m = {*s[0]}, v = {*s[1]};
        m = m + (g - m) * one_minus_beta_1;
        v = v + (g * g - v) * one_minus_beta_2;
        *s[0] = m.x;
        *s[1] = v.x;
        return var - m * lr_t / (sqrt(v) + epsilon);
    }
};

#include "segments.cuh"

template <typename P, typename T, typename Rule>
__device__ void update(const long long* table, int count, Rule rule) {
    P* const* params = reinterpret_cast<P* const*>(table);
    const T* const* grads = reinterpret_cast<const T* const*>(table + count);
    T* const* slots = reinterpret_cast<T* const*>(table + 2 * count);
    const long long* offsets = table + (2 + Rule::kSlots) * count;
    const long long total = offsets[count];
    const long long stride = (long long)gridDim.x * blockDim.x;
    int t = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        t = segment_of(offsets, count, i, t);
        const long long k = i - offsets[t];
        T* s[Rule::kSlots > 0 ? Rule::kSlots : 1];
        for (int j = 0; j < Rule::kSlots; ++j) {
            s[j] = slots[j * count + t] + k;
        }
        P* param = params[t] + k;
        narrow(param, rule(Exact<T>{widen(*param)}, Exact<T>{grads[t][k]}, s).x);
    }
}

#define DISTRIB_OPTIMIZER_KERNELS(P, NAME, T)                                                                   \
    extern "C" __global__ void sgd_##NAME(const long long* table, int count, T lr, T momentum) {                \
        update<P, T>(table, count, Sgd<T>{{lr}});                                                                \
    }                                                                                                            \
    extern "C" __global__ void momentum_##NAME(const long long* table, int count, T lr, T momentum) {           \
        update<P, T>(table, count, Momentum<T, false>{{lr}, {momentum}});                                        \
    }                                                                                                            \
    extern "C" __global__ void nesterov_##NAME(const long long* table, int count, T lr, T momentum) {           \
        update<P, T>(table, count, Momentum<T, true>{{lr}, {momentum}});                                         \
    }                                                                                                            \
    extern "C" __global__ void adam_##NAME(const long long* table, int count, T lr_t, T one_minus_beta_1,       \
                                           T one_minus_beta_2, T epsilon) {                                      \
        update<P, T>(table, count, Adam<T>{{lr_t}, {one_minus_beta_1}, {one_minus_beta_2}, {epsilon}});        \
    }

DISTRIB_OPTIMIZER_KERNELS(unsigned short, float16, float)
DISTRIB_OPTIMIZER_KERNELS(float, float32, float)
DISTRIB_OPTIMIZER_KERNELS(double, float64, double)
