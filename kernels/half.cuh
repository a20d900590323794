// float16 <-> float32 conversions by PTX instruction (no CUDA headers, so NVRTC compiles without a GPU);
// inlined into the kernels that include it by the kernel loader's source() (distrib/backends/cuda/kernels.py).

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
