// float arithmetic as NumPy does it: each operation rounded once to nearest, subnormals kept.
//
// CuPy compiles every RawModule with -ftz=true appended after the caller's options, so the compiler's float
// operations, the __f*_rn intrinsics included, would flush subnormal inputs and results to zero (add.rn.ftz.f32).
// Inline PTX is emitted as written, whatever the flags, and is never contracted into fused multiply-adds.
// double has no flush-to-zero mode: its _rn intrinsics are exact already.
// Inlined into the kernels that include it by the kernel loader's source().

#define DISTRIB_F32_BINARY(NAME, INSTRUCTION)                                      \
    __device__ __forceinline__ float NAME(float a, float b) {                      \
        float r;                                                                   \
        asm(INSTRUCTION " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                \
        return r;                                                                  \
    }

DISTRIB_F32_BINARY(add_rn, "add.rn.f32")
DISTRIB_F32_BINARY(sub_rn, "sub.rn.f32")
DISTRIB_F32_BINARY(mul_rn, "mul.rn.f32")
DISTRIB_F32_BINARY(div_rn, "div.rn.f32")

__device__ __forceinline__ float sqrt_rn(float a) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }
