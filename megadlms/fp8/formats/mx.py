"""MXFP8 (OCP Microscaling Formats v1.0): blocks of 32 consecutive elements along K share one E8M0 scale.

The scale of a block is a power of two X = 2**k (stored as E8M0: the biased exponent k + 127 in one byte; 0xFF
is NaN) and each element is P = cast_E4M3(clamp(V / X, -448, 448)). The spec chooses k = floor(log2(amax)) -
emax (emax = 8 for E4M3), which lets up to amax / X < 512 saturate to 448; rounding the scale up instead, k =
ceil(log2(amax / 448)), never saturates and is what matched BF16 in NVIDIA's MXFP8 pre-training study, so
`rounding="ceil"` is the default and `"floor"` follows the spec. k is clamped to E8M0's range [-127, 127].

How it plugs into the FP8 core: an `mxfp8` quantizer kind calls `quantize_mx` on each GEMM operand in its
K-contiguous form (x and w for fprop; dy and w^T for dgrad; dy^T and x^T for wgrad, each quantized along the
dimension its GEMM contracts) and the GEMM helper calls `mx_gemm(a, b)` = a @ b^T. On CUDA this is torch's MX
scaled GEMM (`torch.nn.functional.scaled_mm` with BlockWise1x32 scales in cuBLAS's swizzled layout, see
`swizzle_scales`), which runs on Blackwell (compute capability 10.x) only; on the CPU it is emulated.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..hardware import FP8UnsupportedError
from ..recipe import E4M3, FP8_MAX, Float8MXScaling, alternatives_on_gpu

__all__ = ["MX_BLOCK", "E8M0", "quantize_mx", "dequantize_mx", "swizzle_scales", "mx_gemm", "check_mx_gemm_support"]

MX_BLOCK = 32
E8M0 = torch.float8_e8m0fnu
_EMAX_E4M3 = 8  # 448 = 1.75 * 2**8
_MANT_175 = 0x600000  # fp32 mantissa field of 1.75


def _mx_exponent(amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """int32 k per block: floor(log2(amax)) - 8 ('floor', the spec) or ceil(log2(amax / 448)) ('ceil').

    Exact integer arithmetic on amax's bits: with amax = 1.m * 2**e, amax / 2**(e - 8) = 1.m * 256 exceeds 448
    exactly when 1.m > 1.75, and then one more power of two is needed."""
    bits = amax.float().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 - _EMAX_E4M3
    if rounding == "ceil":
        k = k + ((bits & 0x7FFFFF) > _MANT_175).int()
    return k.clamp(-127, 127)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e in fp32 for integer e in [-149, 127], built from its bits (exact, including the subnormal 2**-127)."""
    e = e.int()
    bits = torch.where(e >= -126, (e + 127) << 23, 1 << (e + 149).clamp(min=0))
    return bits.view(torch.float32)


def quantize_mx(x: torch.Tensor, rounding: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (any float dtype) -> (q E4M3 [R, C'], scale E8M0 [R, C'/32]), C' = C padded to a multiple of 32.

    Zero-padded columns change no block's amax. A block whose amax is not finite gets the NaN scale (0xFF)."""
    if rounding not in ("ceil", "floor"):
        raise ValueError(f"MXFP8 scale rounding={rounding!r} must be 'ceil' (the default, no saturation) or 'floor' "
                         "(the OCP MX spec)")
    if x.dim() != 2:
        raise ValueError(f"quantize_mx: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    r, c = x.shape
    cp = -(-max(c, 1) // MX_BLOCK) * MX_BLOCK
    xf = F.pad(x.float(), (0, cp - c)).contiguous().view(r, cp // MX_BLOCK, MX_BLOCK)
    amax = xf.abs().amax(dim=2)
    k = _mx_exponent(amax, rounding)
    inv_x = _pow2(-k)
    fmax = FP8_MAX[E4M3]
    q = (xf * inv_x.unsqueeze(2)).clamp_(-fmax, fmax).to(E4M3).view(r, cp)
    biased = torch.where(torch.isfinite(amax), k + 127, 255).to(torch.uint8)
    return q, biased.view(E8M0)


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [R, C] with E8M0 scales [R, C/32] -> fp32 [R, C] (NaN where the scale is NaN)."""
    biased = scale.view(torch.uint8).int()
    x = torch.where(biased == 255, float("nan"), _pow2(biased - 127))
    return q.float() * x.repeat_interleave(MX_BLOCK, dim=1)[:, : q.shape[1]]


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales [R, C/32] -> cuBLAS's block-scaling layout (torch's SwizzleType.SWIZZLE_32_4_4), flat.

    The scale matrix is padded to [ceil(R/128)*128, ceil(C/32 / 4)*4] and cut into 128 x 4 tiles stored one after
    another (row of tiles by row of tiles); inside a tile, the scale of row 32 * i + j (i < 4, j < 32) and column
    c sits at j * 16 + i * 4 + c."""
    r, kb = scale.shape
    rp, kp = -(-r // 128) * 128, -(-kb // 4) * 4
    s = F.pad(scale.view(torch.uint8), (0, kp - kb, 0, rp - r))
    tiles = s.view(rp // 128, 4, 32, kp // 4, 4)  # [row tile, i, j, col tile, c]
    return tiles.permute(0, 3, 2, 1, 4).contiguous().view(E8M0).reshape(-1)


@functools.lru_cache(maxsize=None)
def check_mx_gemm_support(device_index: int) -> None:
    """Raise FP8UnsupportedError (one line, naming the recipes that run there) unless torch's MX GEMM runs on
    cuda:`device_index`."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major not in (Float8MXScaling.gpu_majors or ()):
        name = torch.cuda.get_device_name(device_index)
        raise FP8UnsupportedError(f"--fp8-recipe mxfp8 needs a Blackwell GPU of compute capability 10.x (MX tensor "
                                  f"cores); cuda:{device_index} is {name} ({major}.{minor}): use --fp8-recipe "
                                  f"{alternatives_on_gpu(major, 'mxfp8')}")
    if not (hasattr(F, "scaled_mm") and hasattr(F, "SwizzleType")):
        raise FP8UnsupportedError(f"--fp8-recipe mxfp8 needs torch >= 2.10 (torch.nn.functional.scaled_mm with "
                                  f"BlockWise1x32 scales); this is torch {torch.__version__}")


def _check_operands(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor) -> None:
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"mx_gemm: a {tuple(a_q.shape)} and b {tuple(b_q.shape)} must be [M, K] and [N, K]")
    for name, q, s in (("a", a_q, a_scale), ("b", b_q, b_scale)):
        if q.dtype != E4M3 or s.dtype != E8M0:
            raise ValueError(f"mx_gemm: {name} must be float8_e4m3fn with float8_e8m0fnu scales, got {q.dtype} / "
                             f"{s.dtype}")
        if not q.is_contiguous() or q.shape[0] % 16 or q.shape[1] % MX_BLOCK:
            raise ValueError(f"mx_gemm: {name} {tuple(q.shape)} must be row-major with rows a multiple of 16 and K "
                             "a multiple of 32 (quantize_mx pads K)")
        if tuple(s.shape) != (q.shape[0], q.shape[1] // MX_BLOCK):
            raise ValueError(f"mx_gemm: {name}_scale must be [{q.shape[0]}, {q.shape[1] // MX_BLOCK}] (one per 32 "
                             f"elements along K), got {tuple(s.shape)}")


def mx_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    """(a_q, a_scale) @ (b_q, b_scale)^T accumulated in fp32 -> [M, N] in out_dtype.

    a_q [M, K], b_q [N, K]: E4M3, row-major; scales E8M0 [M, K/32], [N, K/32] (plain row-major, as `quantize_mx`
    returns them; swizzled here for CUDA). CUDA: torch's MX GEMM (compute capability 10.x); CPU: emulated."""
    _check_operands(a_q, a_scale, b_q, b_scale)
    if a_q.device.type == "cuda":
        check_mx_gemm_support(a_q.device.index if a_q.device.index is not None else torch.cuda.current_device())
        st, sw = F.ScalingType, F.SwizzleType
        return F.scaled_mm(a_q, b_q.t(), scale_a=swizzle_scales(a_scale), scale_recipe_a=st.BlockWise1x32,
                           scale_b=swizzle_scales(b_scale), scale_recipe_b=st.BlockWise1x32,
                           swizzle_a=sw.SWIZZLE_32_4_4, swizzle_b=sw.SWIZZLE_32_4_4, output_dtype=out_dtype)
    if a_q.device.type != "cpu":
        raise FP8UnsupportedError(f"mx_gemm: device type {a_q.device.type!r} is not supported; use a Blackwell GPU "
                                  "or the CPU")
    return (dequantize_mx(a_q, a_scale) @ dequantize_mx(b_q, b_scale).t()).to(out_dtype)
