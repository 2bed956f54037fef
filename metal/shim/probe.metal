// Configure-time probe: can this clang++ compile against the shim (address spaces,
// _Float16, ext_vector_type)? If not, meson skips the Metal compile check.
#include <metal_stdlib>
[[kernel]] void pkv_probe(device float* x [[buffer(0)]], uint3 tid [[thread_position_in_grid]]) {
  x[tid.x] = float(half(1.5f)) + as_type<float>(0x3F800000u);
}
