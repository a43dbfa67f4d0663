"""The FP8 fusions conversion installs: `registry` (which fusion goes where, decided once), `fused_linear` (q/k/v
and gate/up as one GEMM), `fused_mlp` (the MLP as one function, the SwiGLU fused into its casts), `swiglu` (the
SwiGLU that keeps its inputs in FP8)."""
