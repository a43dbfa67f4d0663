"""Check the Triton FP8 kernels' transposed stores over many calls, not only the first.

The kernels that write q and q^T in one pass (`triton_cast.cast_transpose_kernel`, the fused SwiGLU kernels) are
checked on their first call in training. A store that reads memory the kernel never wrote (a code-generation
defect: with some ptxas versions a kernel with both an FP8 store and a transposed FP8 store reads stale shared
memory for the transposed one) can pass that check and fail later, depending on what earlier kernels left on
the SM. This script calls every formulation of every kernel many times on fresh inputs of the trainer's shapes,
with other kernels (a BF16 GEMM, a softmax) run in between to leave different data behind, and counts the calls
whose q^T is not q transposed byte for byte (and whose q differs from the torch cast).

    python3 benchmarks/fp8_store_check.py --calls 40                 # with the ptxas Triton bundles
    python3 benchmarks/fp8_store_check.py --calls 40 --ptxas torch   # with torch's (what the trainer uses)
    python3 benchmarks/fp8_store_check.py --calls 40 --ptxas PATH    # with another one

Prints one row per kernel and formulation: calls, calls with a wrong q^T, wrong elements, calls with a wrong q,
and whether it is the formulation training runs (`triton_cast.production_formulation`,
`triton_swiglu.production_formulation`: one per kernel, checked once against torch on its first call). This study
is where the choice of that formulation (and of torch's ptxas, `megadlms.triton_setup.use_torch_ptxas`) is made and
revisited; the library itself does not search.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def ptxas_versions() -> dict[str, str]:
    """The ptxas binaries Triton ships and the CUDA toolkit's, with their versions."""
    import glob

    import torch
    import triton

    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas*"))
    found += glob.glob("/usr/local/cuda*/bin/ptxas")
    found += glob.glob(os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas"))
    out = {}
    for path in sorted(set(found)):
        try:
            text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
            out[path] = text.strip().splitlines()[-1] if text.strip() else "?"
        except Exception as e:  # noqa: BLE001 - a report, not a dependency
            out[path] = f"{type(e).__name__}: {e}"
    return out


def run_checks(calls: int, rows: int, hidden: int, ffn: int, smoke: bool = False) -> list[dict]:
    import torch

    from megadlms.fp8.kernels import triton_cast, triton_swiglu

    # smoke: Triton's interpreter on the CPU, whose emulated conversion does not round to nearest even: rounded in
    # fp32 arithmetic first (the kernels' other rounding)
    dev = torch.device("cpu" if smoke else "cuda")
    sw = smoke
    torch.manual_seed(0)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    scale = torch.tensor(8.0, device=dev)
    dirt_a = torch.randn(64 if smoke else 4096, 64 if smoke else 4096, device=dev, dtype=torch.bfloat16)

    def dirty(i: int) -> None:
        # leave other data in shared memory and L2 between the checked calls
        (dirt_a * (i + 1)).matmul(dirt_a).softmax(-1)

    def same_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())

    def torch_cast(v: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
        fmax = torch.finfo(fp8).max
        return (v.float() * scale).clamp(-fmax, fmax).to(fp8)

    variants = []
    # each kernel as the trainer calls it (amax outputs: 1 for a layer's input cast, 2 for the gate/up gradient), and
    # without amax outputs: a kernel specialisation of its own, which code generation may treat differently
    for src in (torch.bfloat16, torch.float32):
        tile = triton_cast.tile_config(src, True)
        for n_amax in (1, 0):
            for mode in triton_cast.TRANSPOSE_MODES:
                def cast(mode=mode, src=src, tile=tile, n_amax=n_amax):
                    x = torch.randn(rows, hidden, device=dev, dtype=src)
                    amax = [torch.zeros((), device=dev) for _ in range(n_amax)]
                    q, t = triton_cast.cast_transpose(x, scale, e4m3, True, True, amax, t_mode=mode, tile=tile,
                                                      sw_round=sw)
                    return q, t, torch_cast(x, e4m3), 0.0
                variants.append((f"cast {str(src)[6:]}->e4m3 {tile} amax {n_amax}", mode, cast))
    for n_amax in (1, 0):
        for mode in triton_swiglu.FORMULATIONS["fwd"]:
            def fwd(mode=mode, n_amax=n_amax):
                y = torch.randn(rows, 2 * ffn, device=dev, dtype=torch.bfloat16)
                amax = torch.zeros((), device=dev) if n_amax else None
                q, t = triton_swiglu.swiglu_cast(y, scale, e4m3, True, amax, t_mode=mode, sw_round=sw)
                ref = torch_cast(triton_swiglu.swiglu_ref(y[:, :ffn], y[:, ffn:]), e4m3)
                return q, t, ref, 1e-3
            variants.append((f"swiglu fwd {triton_swiglu.TILES['fwd']} amax {n_amax}", mode, fwd))
    for n_amax in (2, 0):
        for mode in triton_swiglu.FORMULATIONS["bwd"]:
            def bwd(mode=mode, n_amax=n_amax):
                dh, gate, up = (torch.randn(rows, ffn, device=dev, dtype=torch.bfloat16) for _ in range(3))
                amax = [torch.zeros((), device=dev) for _ in range(n_amax)]
                q, t = triton_swiglu.swiglu_bwd_cast(dh, gate, up, scale, e5m2, True, True, amax_out=amax,
                                                     t_mode=mode, sw_round=sw)
                ref = torch_cast(torch.cat(triton_swiglu.swiglu_bwd_ref(dh, gate, up), dim=1), e5m2)
                return q, t, ref, 1e-3
            variants.append((f"swiglu bwd {triton_swiglu.TILES['bwd']} amax {n_amax}", mode, bwd))

    results = []
    for name, mode, call in variants:
        bad_t_calls = bad_t_elems = bad_q_calls = 0
        first_bad = None
        for i in range(calls):
            dirty(i)
            q, t, ref, share = call()
            n_t = same_bytes(t, q.t().contiguous())
            if n_t:
                bad_t_calls += 1
                bad_t_elems += n_t
                if first_bad is None:
                    first_bad = i
            # q against torch: exact for the casts; the SwiGLU kernels may differ in silu's last fp32 bit
            if same_bytes(q, ref) > share * q.numel():
                bad_q_calls += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        kind = name.split()[0] if name.startswith("cast") else name.split()[1]
        production = (triton_cast.production_formulation() if kind == "cast"
                      else triton_swiglu.production_formulation(kind))[0]
        results.append({"kernel": name, "formulation": mode, "production": mode == production, "calls": calls,
                        "bad_t_calls": bad_t_calls,
                        "bad_t_elems": bad_t_elems, "first_bad_call": first_bad, "bad_q_calls": bad_q_calls})
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=40, help="calls per kernel and formulation")
    p.add_argument("--rows", type=int, default=16384, help="tokens per micro-batch (qwen3-1.7b: 4 x 4096)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=6144)
    p.add_argument("--ptxas", default="bundled", help="bundled (Triton's own), torch (torch's, what "
                   "megadlms.triton_setup.use_torch_ptxas picks), or a path; each run compiles into a fresh "
                   "Triton cache")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 calls, Triton's interpreter on the CPU")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.calls, a.rows, a.hidden, a.ffn = 2, 64, 128, 128
    if a.worker:
        run_checks(a.calls, a.rows, a.hidden, a.ffn, a.smoke)
        return
    import torch
    import triton

    if not torch.cuda.is_available() and not a.smoke:
        raise SystemExit("fp8_store_check.py needs a CUDA GPU (or --smoke)")
    from megadlms.triton_setup import torch_ptxas

    ptxas = {"bundled": None, "torch": torch_ptxas()}.get(a.ptxas, a.ptxas)
    if a.ptxas == "torch" and ptxas is None:
        raise SystemExit("this torch ships no ptxas (torch/bin/ptxas); pass a path to --ptxas")
    print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                      "device": "cpu (interpreter)" if a.smoke else torch.cuda.get_device_name(),
                      "ptxas found": ptxas_versions(),
                      "torch's ptxas": torch_ptxas(), "this run's TRITON_PTXAS_PATH": ptxas}, indent=1), flush=True)
    env = dict(os.environ, PYTHONPATH=f"{Path(__file__).resolve().parents[1]}{os.pathsep}"
                                      f"{os.environ.get('PYTHONPATH', '')}",
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-cache-"))
    env.pop("TRITON_PTXAS_PATH", None)
    if ptxas is not None:
        env["TRITON_PTXAS_PATH"] = ptxas
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, __file__, "--worker", "--calls", str(a.calls), "--rows", str(a.rows), "--hidden",
           str(a.hidden), "--ffn", str(a.ffn)] + (["--smoke"] if a.smoke else [])
    p_ = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in p_.stdout.splitlines() if line.startswith("{")]
    if p_.returncode:
        print(p_.stdout[-3000:] + p_.stderr[-3000:])
        raise SystemExit(f"worker failed (rc {p_.returncode})")
    print(f"\n{'kernel':44s} {'form.':>5s} {'calls':>5s} {'bad q^T calls':>13s} {'bad q^T elems':>13s} "
          f"{'first bad':>9s} {'bad q calls':>11s} {'training':>8s}")
    for r in rows:
        print(f"{r['kernel']:44s} {r['formulation']:5d} {r['calls']:5d} {r['bad_t_calls']:13d} {r['bad_t_elems']:13d} "
              f"{str(r['first_bad_call']):>9s} {r['bad_q_calls']:11d} {'yes' if r['production'] else '':>8s}")


if __name__ == "__main__":
    main()
