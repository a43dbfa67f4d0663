"""`megadlms generate` end to end on tiny checkpoints (CPU)."""

import argparse
import copy
import json
import sys
import types

import pytest
import torch

from megadlms.cli import generate as cli
from megadlms.config import TransformerConfig
from megadlms.diffusion.fast_sampler import fast_generate
from megadlms.diffusion.sampler import generate
from megadlms.generate.ar import ar_generate
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import save_model_checkpoint

EOD, MASK, PAD = 256, 257, 258


class ByteTokenizer:
    """A stand-in with the interface of megadlms.data's Tokenizer: bytes 0-255 plus three specials."""

    vocab_size, eod_id, mask_id, pad_id = 259, EOD, MASK, PAD

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


@pytest.fixture
def tokenizer(monkeypatch):
    seen = []

    def load_tokenizer(path):
        seen.append(path)
        return ByteTokenizer()

    monkeypatch.setitem(sys.modules, "megadlms.data", types.SimpleNamespace(load_tokenizer=load_tokenizer))
    return seen


def tiny(causal=False, mask_token_id=MASK):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=260, seq_length=128, max_position_embeddings=128,
                            init_method_std=0.3, mask_token_id=mask_token_id,
                            attn_mask_type="causal" if causal else "bidirectional")
    return TransformerLM(cfg).eval(), cfg


def run_cli(argv, capsys):
    args = cli.add_arguments(argparse.ArgumentParser()).parse_args(argv + ["--no-progress"])
    code = cli.run(args)
    out = capsys.readouterr()
    return code, out.out, out.err


PROMPTS = ["Hello", "The cat sat on"]


def test_generate_from_checkpoint_matches_the_sampler(tmp_path, capsys, tokenizer):
    model, cfg = tiny()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    prompt_file = tmp_path / "in.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    argv = ["--load", str(tmp_path / "ckpt"), "--prompt-file", str(prompt_file), "--gen-length", "16",
            "--block-length", "8", "--steps", "8", "--output-file", str(tmp_path / "out.jsonl"), "--ignore-eos"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "[reference] 32 tokens in" in err and "tokens/s (8 forwards, 2 prompts, batch size 2, cpu)" in err
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1] and all(r["num_tokens"] == 16 for r in rows)
    expect = generate(model, [list(p.encode()) for p in PROMPTS], mask_id=MASK, gen_length=16, block_length=8,
                      steps=8, pad_id=PAD)
    assert [r["completion"] for r in rows] == [ByteTokenizer().decode(e) for e in expect]
    assert tokenizer == [None]  # the checkpoint stored no tokenizer: the default one

    # the fast sampler, prompts from the command line, text to stdout
    code, out, err = run_cli(["--load", str(tmp_path / "ckpt"), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                              "--sampler", "fast", "--threshold", "0.5", "--gen-length", "16", "--block-length",
                              "8", "--cache", "prefix"], capsys)
    assert code == 0, err
    expect = fast_generate(model, [list(p.encode()) for p in PROMPTS], mask_id=MASK, gen_length=16,
                           block_length=8, threshold=0.5, cache="prefix", eos_id=EOD, pad_id=PAD)
    assert out == "".join(f">>> {p}\n{ByteTokenizer().decode(e)}\n\n" for p, e in zip(PROMPTS, expect))
    assert "[fast]" in err


def test_causal_checkpoint_decodes_autoregressively(tmp_path, capsys, tokenizer):
    model, cfg = tiny(causal=True, mask_token_id=None)
    save_model_checkpoint(tmp_path / "ar", model, cfg)
    code, out, err = run_cli(["--load", str(tmp_path / "ar"), "--prompt", "Hi", "--max-new-tokens", "5",
                              "--ignore-eos"], capsys)
    assert code == 0, err
    expect = ar_generate(model, [list(b"Hi")], max_new_tokens=5)[0]
    assert out == f">>> Hi\n{ByteTokenizer().decode(expect)}\n\n"
    assert "[ar] 5 tokens in" in err
    code, _, err = run_cli(["--load", str(tmp_path / "ar"), "--prompt", "Hi", "--gen-length", "5"], capsys)
    assert code == 2 and err.strip() == ("megadlms generate: error: --gen-length applies to other samplers, not the "
                                         "ar sampler; its length flags are --max-new-tokens")


def test_hf_and_fp8_loaders_are_used(tmp_path, capsys, tokenizer, monkeypatch):
    model, cfg = tiny()
    calls = []

    def load_hf_model(path, *, device="cpu", dtype=torch.float32, attn_mask_type=None):
        calls.append(("hf", path, str(device), dtype))
        return model, cfg

    def load_fp8_export(path, device="cpu", dtype=torch.bfloat16):
        calls.append(("fp8", path, str(device), dtype))
        return model, cfg

    monkeypatch.setitem(sys.modules, "megadlms.interop.hf", types.SimpleNamespace(load_hf_model=load_hf_model))
    monkeypatch.setitem(sys.modules, "megadlms.fp8.export", types.SimpleNamespace(load_fp8_export=load_fp8_export))
    common = ["--prompt", "x", "--gen-length", "8", "--block-length", "8", "--steps", "4"]
    assert run_cli(["--hf-model", "hfdir"] + common, capsys)[0] == 0
    assert run_cli(["--fp8-export", "fp8dir", "--tokenizer", "tokdir"] + common, capsys)[0] == 0
    assert run_cli(["--fp8-export", "fp8dir", "--tokenizer-model", "tok.json"] + common, capsys)[0] == 0
    assert calls == [("hf", "hfdir", "cpu", torch.float32)] + [("fp8", "fp8dir", "cpu", torch.float32)] * 2
    assert tokenizer == ["hfdir", "tokdir", "tok.json"]  # --tokenizer is --tokenizer-model's alias


def test_compile_flag_compiles_the_layers_for_the_diffusion_samplers(tmp_path, capsys, tokenizer, monkeypatch):
    """--compile compiles each layer (megadlms.distributed.parallelize.apply_compile); the reference and the fast
    sampler run the compiled layers (default stance), and the stance is unchanged afterwards."""
    from torch._dynamo import eval_frame

    from megadlms.distributed import parallelize

    model, cfg = tiny()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    compiled, stances = [], []
    monkeypatch.setattr(parallelize, "apply_compile", lambda m: compiled.append(len(m.layers)))
    real_fast = cli.fast_generate_tokens

    def fast(*a, **k):
        stances.append(eval_frame._stance.stance)
        return real_fast(*a, **k)

    monkeypatch.setattr(cli, "fast_generate_tokens", fast)
    common = ["--load", str(tmp_path / "ckpt"), "--prompt", "Hi", "--gen-length", "8", "--block-length", "8",
              "--compile"]
    code, out, err = run_cli(common + ["--sampler", "reference", "--steps", "4"], capsys)
    assert code == 0, err
    assert compiled == [2] and eval_frame._stance.stance == "default"
    code, out, err = run_cli(common + ["--sampler", "fast"], capsys)
    assert code == 0, err
    assert stances == ["default"] and eval_frame._stance.stance == "default"


def test_compiled_layers_serve_the_cached_samplers_without_recompiling_per_layer():
    """The cache is called outside the compiled graphs (megadlms.model._cache_update), so one compilation of a
    layer serves every layer, cache and mode: the fast sampler with the dual and the prefix cache on per-layer
    compiled layers stays under torch.compile's recompile limit and picks the eager model's tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megadlms.diffusion.fast_sampler import fast_generate_tokens
    from megadlms.distributed.parallelize import apply_compile

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=10, hidden_size=32, num_attention_heads=4, num_query_groups=2,  # > the limit
                            ffn_hidden_size=64, vocab_size=260, seq_length=64, init_method_std=0.3, mask_token_id=MASK)
    model = TransformerLM(cfg).eval()
    compiled = copy.deepcopy(model)
    apply_compile(compiled)
    torch._dynamo.reset()
    counters.clear()
    prompt = torch.randint(0, MASK, (1, 6))
    for cache in ("dual", "prefix"):
        kw = dict(mask_id=MASK, gen_length=8, block_length=4, threshold=0.9, cache=cache)
        got, _ = fast_generate_tokens(compiled, prompt, **kw)
        want, _ = fast_generate_tokens(model, prompt, **kw)
        assert torch.equal(got, want), cache
    # guarding on the layer index would compile the layer once per layer (10 layers, past the limit of 8); the first
    # layer, which has no residual input from a layer before it, is one more graph per mode
    assert not any("recompile limit" in k for k in counters["unimplemented"]), list(counters["unimplemented"])
    assert counters["stats"]["unique_graphs"] <= 14, dict(counters["stats"])


def test_fuse_projections_flag_gives_the_same_text(tmp_path, capsys, tokenizer, monkeypatch):
    """--fuse-projections (default on GPU) fuses the loaded model's q/k/v and gate/up; the output is unchanged."""
    from megadlms.generate import fuse

    model, cfg = tiny()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    fused = []
    real = fuse.fuse_projections
    monkeypatch.setattr(fuse, "fuse_projections", lambda m: fused.append(real(m)))
    common = ["--load", str(tmp_path / "ckpt"), "--prompt", "Hello", "--gen-length", "16", "--block-length", "8",
              "--steps", "8", "--ignore-eos"]
    plain = run_cli(common, capsys)
    assert plain[0] == 0 and fused == []  # CPU default: off
    assert run_cli(common + ["--fuse-projections"], capsys)[1] == plain[1] and fused == [4]


def test_bad_input_gives_clear_errors(tmp_path, capsys, tokenizer):
    model, cfg = tiny()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    base = ["--load", str(tmp_path / "ckpt"), "--prompt", "hi"]
    code, _, err = run_cli(base + ["--gen-length", "100", "--block-length", "32"], capsys)
    assert code == 2 and "gen_length=100 is not divisible by block_length=32" in err
    code, _, err = run_cli(base + ["--gen-length", "64", "--block-length", "8", "--steps", "100"], capsys)
    assert code == 2 and "use a multiple of 8" in err
    code, _, err = run_cli(base + ["--mask-token", "300"], capsys)
    assert code == 2 and "mask_id=300 is outside the vocabulary [0, 260)" in err
    code, _, err = run_cli(base + ["--gen-length", "128", "--block-length", "128"], capsys)
    assert code == 2 and "exceeds the model's max_position_embeddings=128" in err
    code, _, err = run_cli(base + ["--max-new-tokens", "16", "--steps", "8"], capsys)  # the reference sampler
    assert code == 2 and ("--max-new-tokens applies to other samplers, not the reference sampler; its length flags "
                          "are --gen-length and --block-length and --steps") in err
    code, _, err = run_cli(base + ["--sampler", "fast", "--steps", "8", "--block-length", "8"], capsys)
    assert code == 2 and "--steps applies to other samplers, not the fast sampler" in err
    code, _, err = run_cli(["--load", str(tmp_path / "ckpt")], capsys)
    assert code == 2 and "no prompts" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    code, _, err = run_cli(["--load", str(tmp_path / "ckpt"), "--prompt-file", str(bad)], capsys)
    assert code == 2 and 'bad.jsonl:1 needs a "prompt" string' in err


def test_with_the_bundled_tokenizer(tmp_path, capsys):
    from megadlms.data import default_tokenizer_path, load_tokenizer

    tok = load_tokenizer(None)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            vocab_size=tok.vocab_size, seq_length=64, init_method_std=0.3)
    model = TransformerLM(cfg).eval()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg, tokenizer_dir=default_tokenizer_path())
    code, out, err = run_cli(["--load", str(tmp_path / "ckpt"), "--prompt", "Hello world", "--gen-length", "8",
                              "--block-length", "4", "--steps", "4", "--ignore-eos"], capsys)
    assert code == 0, err  # the mask id comes from the tokenizer (the config has none)
    expect = generate(model, [tok.encode("Hello world")], mask_id=tok.mask_id, gen_length=8, block_length=4,
                      steps=4)[0]
    assert out == f">>> Hello world\n{tok.decode(expect)}\n\n"
    assert "tokens/s (4 forwards, 1 prompt, batch size 1, cpu)" in err  # the batch that ran, not --batch-size 8
    args = cli.add_arguments(argparse.ArgumentParser()).parse_args(["--load", str(tmp_path / "ckpt"), "--prompt",
                                                                    "Hello", "--gen-length", "4", "--steps", "4",
                                                                    "--block-length", "4"])
    assert cli.run(args) == 0
    assert "step/s" not in capsys.readouterr().err  # stderr is no terminal: no progress bar without --no-progress


def test_dream_sampler_flags(tmp_path, capsys, tokenizer):
    """--sampler dream --alg --alg-temp runs Dream's decoding orders with the given seed; its flags are refused
    with another sampler."""
    from megadlms.diffusion.dream_sampler import dream_generate

    model, cfg = tiny()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    base = ["--load", str(tmp_path / "ckpt"), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--gen-length", "12",
            "--steps", "6", "--ignore-eos", "--seed", "5"]
    for alg, extra, kw in [("entropy", [], {}), ("maskgit_plus", ["--alg-temp", "0.5", "--temperature", "0.7"],
                                                 dict(alg_temp=0.5, temperature=0.7))]:
        code, out, err = run_cli(base + ["--sampler", "dream", "--alg", alg] + extra, capsys)
        assert code == 0, err
        assert err.startswith("[dream] ") and "(6 forwards, 2 prompts" in err
        expect = dream_generate(model, [list(p.encode()) for p in PROMPTS], mask_id=MASK, gen_length=12, steps=6,
                                alg=alg, pad_id=PAD, generator=torch.Generator().manual_seed(5), top_p=1.0, **kw)
        assert out == "".join(f">>> {p}\n{ByteTokenizer().decode(e)}\n\n" for p, e in zip(PROMPTS, expect))
    code, out, err = run_cli(base + ["--sampler", "reference", "--alg", "entropy"], capsys)
    assert code == 2 and "--alg applies to Dream's sampler, not the reference sampler; add --sampler dream" in err
    # a model imported from Dream decodes with Dream's sampler unless told otherwise
    save_model_checkpoint(tmp_path / "dream", model, cfg.replace(extra={"hf_architecture": "DreamModel"}))
    code, out, err = run_cli(["--load", str(tmp_path / "dream")] + base[2:] + ["--alg", "entropy"], capsys)
    assert code == 0 and err.startswith("[dream] "), err
