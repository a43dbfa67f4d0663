"""The FP8 kernels: `ops` (the one interface the engine calls: casts, transposes, amaxes, current scales, each a
Triton kernel checked against its torch reference on first use), `primitives` (the torch casts and scale
arithmetic, the references), `triton_cast` and `triton_swiglu` (the Triton kernels)."""
