"""The one-pass FP8 cast kernel (`megadlms.fp8.kernels.triton_cast`) on the training shapes, by tile configuration.

For each cast the trainer makes per layer (the inputs, gradients and fp32 master weights of qwen3-1.7b at
B=4 S=4096 and of llama3-8b at B=2 S=4096), every (rows, columns, warps) tile and transposed-store formulation
is timed (CUDA events, median of `--iters`) and its output checked bitwise against the ATen cast. Bandwidth is
counted as the bytes the cast must move (read x once, write q and q^T) and compared with a device-to-device
copy of the same bytes, the practical floor.

`--kinds amax` times the amax kernel of current scaling (`triton_cast.amax`) by (block, warps, programs per SM)
against ATen's reduction, each call of both timed inside a CUDA graph (the host's launch latency, which is
longer than these kernels, would otherwise be timed), bandwidth counted as one read of x. `--kinds swiglu_amax`
does the same for the amax passes of the fused FP8 MLP under current scaling (`triton_swiglu.swiglu_amax`, one
read of y = [gate, up]; `swiglu_bwd_amax`, one read of dh, gate and up) by (rows, columns, warps, programs per
SM), against the amax kernel over a tensor of the same bytes. `--kinds rowwise` times the rowwise recipe's casts
(`triton_cast.rowwise_cast`: both copies, scaled per row and per column, from two reads of x) by tile against the
torch casts they replace, each checked bitwise against them, bandwidth counted as two reads of x and the writes of
q and q^T.

    python3 benchmarks/fp8_cast_sweep.py            # on a GPU
    TRITON_INTERPRET=1 python3 benchmarks/fp8_cast_sweep.py --smoke   # small shapes on the CPU (a check)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.fp8.kernels import triton_cast, triton_swiglu  # noqa: E402

TILES = [(64, 64, 4), (64, 64, 8), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (32, 128, 4),
         (32, 64, 2)]

# name, rows, cols, source dtype, FP8 dtype, amax outputs, column block of a wider q (the fused gradient)
SHAPES = [
    ("qwen qkv input", 16384, 2048, torch.bfloat16, torch.float8_e4m3fn, 3, None),
    ("qwen down input", 16384, 6144, torch.bfloat16, torch.float8_e4m3fn, 1, None),
    ("qwen gate/up grad part", 16384, 6144, torch.bfloat16, torch.float8_e5m2, 2, 12288),
    ("qwen o/down grad", 16384, 2048, torch.bfloat16, torch.float8_e5m2, 1, None),
    ("qwen gate weight fp32", 6144, 2048, torch.float32, torch.float8_e4m3fn, 1, None),
    ("qwen down weight fp32", 2048, 6144, torch.float32, torch.float8_e4m3fn, 1, None),
    ("llama down input", 8192, 14336, torch.bfloat16, torch.float8_e4m3fn, 1, None),
    ("llama gate/up grad part", 8192, 14336, torch.bfloat16, torch.float8_e5m2, 2, 28672),
    ("llama gate weight fp32", 14336, 4096, torch.float32, torch.float8_e4m3fn, 1, None),
]


def time_us(fn, iters: int) -> float:
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    events = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            continue
        # no synchronisation between calls: the host queues ahead, so a call's time is the GPU's, not the host's
        # launch latency (as in training, where CUDA graphs or a queue ahead hide it)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) * 1e3 for a, b in events]
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--modes", default="0,1", help="transposed-store formulations to try (triton_cast.TRANSPOSE_MODES)")
    p.add_argument("--roundings", default="hw,sw", help="roundings to try: hw (the conversion instruction's), "
                   "sw (in fp32 arithmetic first); see triton_cast.ROUNDINGS")
    p.add_argument("--tiles", default="", help="tiles to try, e.g. 64x64x4,64x128x4 (rows x columns x warps); "
                   "default: all of TILES")
    p.add_argument("--kinds", default="cast,swiglu", help="which kernels: cast (triton_cast), swiglu (triton_swiglu), "
                   "amax (triton_cast.amax), swiglu_amax (triton_swiglu.swiglu_amax, swiglu_bwd_amax), rowwise "
                   "(triton_cast.rowwise_cast)")
    p.add_argument("--smoke", action="store_true", help="shapes / 64, two tiles, CPU (with TRITON_INTERPRET=1)")
    a = p.parse_args()
    dev = torch.device("cpu" if a.smoke else "cuda")
    x0 = torch.empty(1, 1, device=dev)
    assert triton_cast.available(x0), "the Triton cast is not available here"
    modes = [int(m) for m in a.modes.split(",")]
    roundings = [{"hw": False, "sw": True}[r] for r in a.roundings.split(",")]
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")] if a.tiles else TILES
    tiles = tiles[:2] if a.smoke else tiles
    shapes = [(n, r // 64, c // 64, dt, f8, k, w // 64 if w else None) for n, r, c, dt, f8, k, w in SHAPES] \
        if a.smoke else SHAPES
    name = "CPU (Triton interpreter)" if a.smoke else torch.cuda.get_device_name()
    print(f"FP8 cast sweep | torch {torch.__version__} | {name}")
    summary = []
    kinds = a.kinds.split(",")
    for name, r, c, dt, f8, n_amax, wide in shapes if "cast" in kinds else []:
        g = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(r, c, device=dev, generator=g) * 3).to(dt)
        a.iters = 2 if a.smoke else a.iters
        scale = torch.tensor(40.0, device=dev)
        fmax = torch.finfo(f8).max
        ref = (x.float() * scale).clamp(-fmax, fmax).to(f8)
        ref_t = ref.t().contiguous()
        amaxes = [torch.zeros((), device=dev) for _ in range(n_amax)]
        qbuf = torch.empty(r, wide or c, dtype=f8, device=dev)
        tbuf = torch.empty(wide or c, r, dtype=f8, device=dev)
        q_out, t_out = qbuf[:, :c], tbuf[:c]
        moved = r * c * (x.element_size() + 2)
        src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_us = time_us(lambda: dst.copy_(src), a.iters)  # reads + writes `moved` bytes
        cast_variants = [(m, sw) for sw in roundings for m in modes]

        def run(tile, variant, marker=False):
            if marker:  # unwritten elements must show
                triton_cast.fill_unwritten_marker(q_out, t_out)
            triton_cast.cast_transpose(x, scale, f8, True, True, amaxes, q_out, t_out, variant[0], tile, variant[1])
            return q_out, t_out

        def check(q, t):
            return (torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
                    and torch.equal(t.view(torch.uint8), ref_t.view(torch.uint8))
                    and all(float(m) == float(x.float().abs().max()) for m in amaxes))

        rows = measure(name, tiles, cast_variants, run, check, moved, a.iters)
        summary.append((name, moved, copy_us, chosen(rows, triton_cast.tile_config(dt, True), cast_variants),
                        fastest(rows)))
    if "swiglu" in kinds:
        summary += sweep_swiglu(dev, tiles, roundings, a)
    if "amax" in kinds:
        sweep_amax(dev, a)
    if "swiglu_amax" in kinds:
        sweep_swiglu_amax(dev, a)
    if "rowwise" in kinds:
        sweep_rowwise(dev, a)
    if "cast" not in kinds and "swiglu" not in kinds:
        return
    print("\nbytes moved = read x + write q + write q^T; copy = a device copy of the same bytes")
    print("now = the library's tile and the first (formulation, rounding) in its order that passed; best = the "
          "fastest that passed; a formulation with 's': rounded in fp32 arithmetic")
    print_summary("cast", "copy", "best tile, mode", summary,
                  lambda best: f"{best[1] if best else '-'}, {label(best[2]) if best else '-'}")


def print_summary(kind: str, baseline: str, best_what: str, rows: list, describe_best) -> None:
    """One line per tensor: (name, bytes, baseline us, now row or None, best row or None) against the baseline."""
    print(f"{kind:24s} {'MB':>6s} {baseline + ' us':>8s} {baseline + ' GB/s':>9s} {'now us':>8s} {'now GB/s':>8s} "
          f"{'best us':>8s} {'best GB/s':>9s}  {best_what}")
    for name, nbytes, base_us, now, best in rows:
        now_us = now[0] if now else float("nan")
        best_us = best[0] if best else float("nan")
        print(f"{name:24s} {nbytes / 1e6:6.0f} {base_us:8.1f} {nbytes / base_us / 1e3:9.0f} {now_us:8.1f} "
              f"{nbytes / now_us / 1e3:8.0f} {best_us:8.1f} {nbytes / best_us / 1e3:9.0f}  {describe_best(best)}")


def label(variant: tuple[int, bool]) -> str:
    """(formulation, rounded in fp32) -> '1' or '1s'."""
    return f"{variant[0]}{'s' if variant[1] else ''}"


def measure(name: str, tiles, variants, run, check, moved: int, iters: int) -> list:
    """(us, tile, variant, ok) for every tile and (formulation, rounding): the output of a first call made with
    marker-filled outputs checked by `check(q, t)`, then the median time of `iters` calls."""
    rows = []
    for tile in tiles:
        for variant in variants:
            try:
                ok = check(*run(tile, variant, True))
                us = time_us(lambda: run(tile, variant), iters)
            except Exception as e:  # a tile this Triton cannot build
                print(f"  {name} tile {tile} mode {label(variant)}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append((us, tile, variant, ok))
            print(f"  {name:24s} tile {str(tile):15s} mode {label(variant):3s} {us:8.1f} us  "
                  f"{moved / us / 1e3:7.0f} GB/s  {'ok' if ok else 'WRONG'}", flush=True)
    return rows


def chosen(rows: list, tile: tuple, order) -> tuple | None:
    """What the library runs: at its tile, the first formulation in its order of trial that passed the check."""
    ok = {r[2]: r for r in rows if r[1] == tile and r[3]}
    return next((ok[m] for m in order if m in ok), None)


def fastest(rows: list) -> tuple | None:
    good = sorted(r for r in rows if r[3])
    return good[0] if good else None


# name, tokens, ffn
SWIGLU_SHAPES = [("qwen", 16384, 6144), ("llama", 8192, 14336)]


def swiglu_inputs(dev, m: int, f: int, smoke: bool):
    """(m, f, y = [gate, up] [m, 2f], dh [m, f]) in BF16 for a SwiGLU shape (/ 64 each with --smoke), seeded."""
    if smoke:
        m, f = m // 64, f // 64
    g = torch.Generator(device=dev).manual_seed(0)
    y = (torch.randn(m, 2 * f, device=dev, generator=g) * 2).bfloat16()
    return m, f, y, torch.randn(m, f, device=dev, generator=g).bfloat16()


def sweep_swiglu(dev, tiles, roundings, a) -> list:
    """The fused SwiGLU + FP8 cast kernels (forward: y [M, 2F] -> h q, h^T; backward: dh, y -> [d_gate, d_up] q,
    ^T) by tile and formulation of q^T (`triton_swiglu.FORMULATIONS`), checked as their first call is."""
    summary = []
    for name, m, f in SWIGLU_SHAPES:
        m, f, y, dh = swiglu_inputs(dev, m, f, a.smoke)
        scale = torch.tensor(8.0, device=dev)
        h_ref = (triton_swiglu.swiglu_ref(y[:, :f], y[:, f:]) * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        d_ref = (torch.cat(triton_swiglu.swiglu_bwd_ref(dh, y[:, :f], y[:, f:]), 1) * scale).clamp(
            -57344, 57344).to(torch.float8_e5m2)
        amax = [torch.zeros((), device=dev) for _ in range(2)]
        # bytes the fused kernel must move (read y (and dh), write q and q^T) -- the transpose kernel adds a pass
        for kind, moved, ref in (("fwd", 6 * m * f, h_ref), ("bwd", 10 * m * f, d_ref)):
            src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy_us = time_us(lambda: dst.copy_(src), a.iters)

            def run(tile, variant, marker=False, kind=kind):
                mode, sw = variant
                if kind == "fwd":
                    return triton_swiglu.swiglu_cast(y, scale, torch.float8_e4m3fn, True, amax[0], mode, tile, marker,
                                                     sw)
                return triton_swiglu.swiglu_bwd_cast(dh, y[:, :f], y[:, f:], scale, torch.float8_e5m2, True, True,
                                                     None, amax, mode, tile, marker, sw)

            def check(q, t, ref=ref):
                return triton_swiglu._codes_close(q, ref) and torch.equal(t.view(torch.uint8), q.view(torch.uint8).t())

            variants = [(m, sw) for sw in roundings for m in triton_swiglu.FORMULATIONS[kind]]
            what = f"swiglu {kind} {name}"
            rows = measure(what, tiles, variants, run, check, moved, a.iters)
            summary.append((what, moved, copy_us, chosen(rows, triton_swiglu.TILES[kind], variants), fastest(rows)))
    return summary


# name, rows, cols, dtype: the tensors current scaling takes the amax of (activations and gradients in BF16, master
# weights in fp32 where no optimizer keeps their amax)
AMAX_SHAPES = [("llama qkv/o input", 8192, 4096, torch.bfloat16), ("llama down input", 8192, 14336, torch.bfloat16),
               ("qwen qkv/o input", 16384, 2048, torch.bfloat16), ("llama gate weight fp32", 14336, 4096,
                                                                   torch.float32)]
AMAX_TILES = [(b, w, p) for b in (2048, 4096, 8192, 16384) for w in (4, 8, 16) for p in (2, 4, 8, 16)]


def graph_us(fn, calls: int = 20, replays: int = 5) -> float:
    """Microseconds per call of fn, `calls` of them captured in one CUDA graph and replayed (median replay)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def time_tiles(label: str, tiles, run, agrees, nbytes: int, timer, tile_now) -> tuple:
    """Each tile's run(tile) checked by agrees(result) and timed (bandwidth: one read of `nbytes`), one line each;
    returns the (us, tile, ok) rows of the library's tile (None if not swept) and of the fastest that agreed."""
    rows = []
    for tile in tiles:
        ok = bool(agrees(run(tile)))
        us = timer(lambda tile=tile: run(tile))
        rows.append((us, tile, ok))
        print(f"  {label} tile {str(tile):18s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s  {'ok' if ok else 'WRONG'}",
              flush=True)
    now = next((r for r in rows if r[1] == tile_now), None)
    return now, min((r for r in rows if r[2]), default=None)


def sweep_amax(dev, a) -> None:
    """The amax kernel by tile against ATen's inf-norm reduction (what the casts used before it)."""
    shapes = [(n, r // 64, c // 64, dt) for n, r, c, dt in AMAX_SHAPES] if a.smoke else AMAX_SHAPES
    tiles = AMAX_TILES[:2] if a.smoke else AMAX_TILES
    timer = graph_us if dev.type == "cuda" else (lambda fn: time_us(fn, 2))
    results = []
    for name, r, c, dt in shapes:
        x = (torch.randn(r, c, device=dev, generator=torch.Generator(device=dev).manual_seed(0)) * 3).to(dt)
        want = torch.linalg.vector_norm(x, float("inf")).float()
        aten_us = timer(lambda: torch.linalg.vector_norm(x, float("inf")))
        now, best = time_tiles(f"amax {name:24s}", tiles, lambda tile, x=x: triton_cast.amax(x, tile),
                               lambda got, want=want: torch.equal(got, want), x.nbytes, timer, triton_cast.AMAX_TILE)
        results.append((name, x.nbytes, aten_us, now, best))
    print("\namax: one read of x; now = the library's tile (AMAX_TILE); best = the fastest that agreed with ATen")
    print_summary("amax", "ATen", "best tile (block, warps, programs/SM)", results,
                  lambda best: f"{best[1] if best else '-'}")


SWIGLU_AMAX_TILES = [(r, c, w, p) for r, c in ((8, 512), (16, 256), (32, 128), (32, 256), (16, 512)) for w in (4, 8)
                     for p in (2, 4, 8)]


def sweep_swiglu_amax(dev, a) -> None:
    """The amax passes of the fused MLP under current scaling by tile, checked against torch's amax of the same
    fp32 values (within 1e-3, as their first call is), against `triton_cast.amax` over a tensor of the same bytes
    (the plain read's speed)."""
    tiles = SWIGLU_AMAX_TILES[:2] if a.smoke else SWIGLU_AMAX_TILES
    timer = graph_us if dev.type == "cuda" else (lambda fn: time_us(fn, 2))
    results = []
    for name, m, f in SWIGLU_SHAPES:
        m, f, y, dh = swiglu_inputs(dev, m, f, a.smoke)
        gate, up = y[:, :f], y[:, f:]
        cases = (("fwd", y.nbytes, lambda tile: triton_swiglu.swiglu_amax(y, tile),
                  triton_swiglu.swiglu_ref(gate, up).abs().amax()),
                 ("bwd", y.nbytes + dh.nbytes, lambda tile: triton_swiglu.swiglu_bwd_amax(dh, gate, up, None, tile),
                  torch.cat(triton_swiglu.swiglu_bwd_ref(dh, gate, up), 1).abs().amax()))
        for kind, nbytes, run, want in cases:
            flat = torch.randn(nbytes // 2, device=dev).bfloat16()
            base_us = timer(lambda: triton_cast.amax(flat))
            now, best = time_tiles(f"swiglu amax {kind} {name:6s}", tiles, run,
                                   lambda got, want=want: torch.allclose(got, want, rtol=1e-3, atol=0.0), nbytes,
                                   timer, triton_swiglu.AMAX_TILES[kind])
            results.append((f"swiglu amax {kind} {name}", nbytes, base_us, now, best))
    print("\nswiglu amax: one read of the inputs; amax = triton_cast.amax over the same bytes; now = the library's "
          "tile (AMAX_TILES); best = the fastest that agreed with torch")
    print_summary("swiglu amax", "amax", "best tile (rows, cols, warps, programs/SM)", results,
                  lambda best: f"{best[1] if best else '-'}")


ROWWISE_TILES = [(64, 128, 8), (64, 128, 4), (32, 128, 4), (128, 64, 8), (64, 64, 4), (128, 128, 8)]


def sweep_rowwise(dev, a) -> None:
    """The rowwise recipe's casts (both copies, as the layers ask for an input or a gradient) by tile, checked
    bitwise against the torch casts they replace and timed against them."""
    from megadlms.fp8.kernels.primitives import quantize_rowwise

    # smoke: three shapes / 64 (bf16 inputs and gradients, an fp32 weight)
    shapes = [(n, r // 64, c // 64, dt, f8) for n, r, c, dt, f8, _, _ in (SHAPES[1], SHAPES[3], SHAPES[4])] \
        if a.smoke else [(n, r, c, dt, f8) for n, r, c, dt, f8, _, _ in SHAPES]
    tiles = ROWWISE_TILES[:2] if a.smoke else ROWWISE_TILES
    timer = graph_us if dev.type == "cuda" else (lambda fn: time_us(fn, 2))
    results = []
    for name, r, c, dt, f8 in shapes:
        x = (torch.randn(r, c, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
             * torch.logspace(-2, 2, r, device=dev)[:, None]).to(dt)
        want = triton_cast._rowwise_reference(x, f8, True, True, 0)

        def torch_casts(x=x, f8=f8):
            q, si = quantize_rowwise(x, f8, 1)
            qc, sc = quantize_rowwise(x, f8, 0)
            return q, qc.t().contiguous(), si, sc

        torch_us = timer(torch_casts)
        moved = 2 * x.nbytes + 2 * x.numel()
        now, best = time_tiles(f"rowwise {name:24s}", tiles,
                               lambda tile, x=x, f8=f8: triton_cast.rowwise_cast(x, f8, True, True, 0, tile),
                               lambda got, want=want: all(triton_cast._same_bits(g, w) for g, w in zip(got, want)),
                               moved, timer, triton_cast.ROWWISE_TILE)
        results.append((name, moved, torch_us, now, best))
    print("\nrowwise: two reads of x, writes of q and q^T; torch = the torch casts of both copies; now = the library's "
          "tile (ROWWISE_TILE); best = the fastest that agreed with torch")
    print_summary("rowwise", "torch", "best tile (rows, cols, warps)", results,
                  lambda best: f"{best[1] if best else '-'}")


if __name__ == "__main__":
    main()
