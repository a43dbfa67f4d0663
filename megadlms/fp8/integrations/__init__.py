"""What the FP8 layers plug into: `param_gather` (FSDP2's FP8 weight all-gather), `graph_weights` (FP8 weights of
CUDA-graphed layers), `weight_amax` / `kept_amax` (weight amaxes kept by the optimizer step), `monitor` (telemetry)."""
