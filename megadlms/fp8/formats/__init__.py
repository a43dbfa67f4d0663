"""The finer-scaled FP8 formats: `blockwise` (1x128 tiles, 128x128 blocks) and `mx` (MXFP8, 1x32 E8M0 scales),
each with its casts and its GEMM."""
