"""The lm-evaluation-harness model class end to end on local tasks (multiple choice, perplexity, generation)."""

import json
import math
import re
import shutil
import threading

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megadlms.config import ConfigError
from megadlms.data import default_tokenizer_path
from megadlms.diffusion.sampler import generate
from megadlms.eval import likelihood as lk
from megadlms.eval.harness import MegaDLMsLM

ARGS = dict(mc_num=3, gen_length=8, block_length=4, steps=4, batch_size=4, max_length=16, device="cpu")


def evaluate(lm, tasks, files, **kw):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True, bootstrap_iters=0,
                                   task_manager=TaskManager(include_path=str(files["tasks"]), include_defaults=False),
                                   **kw)


@pytest.fixture(scope="module")
def run(eval_files):
    lm = MegaDLMsLM(load=str(eval_files["dlm"]), **ARGS)
    return lm, evaluate(lm, ["tiny_mc", "tiny_ppl", "tiny_gen"], eval_files)


def _reqs(pairs, kind="loglikelihood"):
    return [Instance(request_type=kind, doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]


def test_multiple_choice_is_llada_mc_estimate(run):
    lm, res = run
    samples = res["samples"]["tiny_mc"]
    correct = []
    for s in samples:
        lls = [r[0][0] for r in s["resps"]]
        for (context, choice), ll, (_, greedy) in zip(s["arguments"], lls, [r[0] for r in s["resps"]]):
            ctx, cont = lm._encode_pair(context, choice)
            assert ll == pytest.approx(lk.mc_loglikelihood(lm.model, [(ctx, cont)], mask_id=1, mc_num=3,
                                                           seed=1234)[0], rel=1e-5)
            assert greedy == lk.greedy_decodes_target(lm.model, [(ctx, cont)], mask_id=1)[0]
        correct.append(max(range(len(lls)), key=lls.__getitem__) == s["doc"]["label"])
    assert res["results"]["tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_perplexity_task_is_the_elbo_over_windows(run):
    lm, res = run
    total_ll, words = 0.0, 0
    for s in res["samples"]["tiny_ppl"]:
        text = s["doc"]["text"]
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(lm.tok_encode(text), 0, 15, 1)]
        assert len(windows) >= 1 and all(len(c) + len(t) <= 16 for c, t in windows)
        ll = -lk.elbo_nll(lm.model, windows, mask_id=1, seed=1234).mean(1).sum().item()
        assert s["resps"][0][0] == pytest.approx(ll, rel=1e-5)
        total_ll += ll
        words += len(re.split(r"\s+", text))  # the harness's word count
    result = res["results"]["tiny_ppl"]
    assert result["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / words), rel=1e-6)
    assert result["bits_per_byte,none"] > 0


def test_generation_task_uses_the_sampler_and_stops(run):
    lm, res = run
    samples = res["samples"]["tiny_gen"]
    prompts = [lm.tok_encode(s["arguments"][0][0]) for s in samples]
    direct = generate(lm.model, prompts, mask_id=1, gen_length=8, block_length=4, steps=4, eos_id=0, pad_id=2)
    for s, ids in zip(samples, direct):
        text = lm.tokenizer.decode([t for t in ids if t != 1])
        for stop in ("\n", "."):
            text = text.split(stop)[0]
        assert s["resps"][0][0] == text
        assert "\n" not in s["resps"][0][0] and "." not in s["resps"][0][0]


def test_registered_by_name_beside_the_harness_models(run, eval_files):
    from lm_eval.api.registry import get_model
    from lm_eval.models.dummy import DummyLM

    assert get_model("megadlms") is MegaDLMsLM and get_model("dummy") is DummyLM  # lm_eval's own names still load
    # what `--model megadlms --model_args k=v,...` builds: the values arrive as strings
    model_args = ",".join(f"{k}={v}" for k, v in {"load": eval_files["dlm"], **ARGS}.items())
    by_name = get_model("megadlms").create_from_arg_string(model_args)
    pairs = _reqs([("The cat sat", " on the mat")])
    assert by_name.loglikelihood(pairs) == run[0].loglikelihood(pairs)


def test_seeds_make_runs_identical(eval_files):
    pairs = [("The cat sat", " on the mat"), ("Once", " upon a time")]
    a = MegaDLMsLM(load=str(eval_files["dlm"]), **{**ARGS, "seed": 5, "greedy": "off"})
    first, again = a.loglikelihood(_reqs(pairs)), a.loglikelihood(_reqs(pairs[::-1]))[::-1]
    assert first == again
    b = MegaDLMsLM(model=a.model, tokenizer=a.tokenizer, **{**ARGS, "seed": 6, "greedy": "off"})
    assert b.loglikelihood(_reqs(pairs)) != first
    gens = [("Lily", {"until": ["\n"]})]
    c = MegaDLMsLM(model=a.model, tokenizer=a.tokenizer, **{**ARGS, "temperature": 1.0, "sampler": "fast"})
    assert c.generate_until(_reqs(gens, "generate_until")) == c.generate_until(_reqs(gens, "generate_until"))


def test_autoregressive_checkpoint_is_exact(eval_files):
    lm = MegaDLMsLM(load=str(eval_files["ar"]), **ARGS)
    pairs = [("The cat sat", " on the mat"), ("Tom", " had a toy")]
    enc = [lm._encode_pair(c, t) for c, t in pairs]
    got, exact = lm.loglikelihood(_reqs(pairs)), lk.ar_loglikelihood(lm.model, enc)
    assert [g for _, g in got] == [g for _, g in exact]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in exact], rel=1e-6)
    text = "Lily saw a big red ball in the park and Tom had a toy car."
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(lm.tok_encode(text), 0, 16, 1)]
    exact = sum(lp for lp, _ in lk.ar_loglikelihood(lm.model, windows))
    assert lm.loglikelihood_rolling(_reqs([(text,)], "loglikelihood_rolling"))[0] == pytest.approx(exact, rel=1e-6)


class _FakeWorld:
    """Two ranks in two threads: all_gather / gather_object / barrier through shared slots."""

    def __init__(self):
        self.slots, self.sync = [None, None], threading.Barrier(2)

    def attach(self, lm, rank):
        lm._rank, lm._world_size = rank, 2

        def exchange(obj):
            self.slots[rank] = obj
            self.sync.wait()
            out = list(self.slots)
            self.sync.wait()
            return out

        lm.all_gather = lambda t: torch.stack(exchange(t))
        lm.gather_object = lambda obj, dst=0: exchange(obj) if rank == dst else (exchange(obj), None)[1]
        lm.barrier = self.sync.wait


def test_data_parallel_split_and_gather_match_one_process(run, eval_files):
    lm, res = run
    world, results = _FakeWorld(), [None, None]
    ranks = [MegaDLMsLM(model=lm.model, tokenizer=lm.tokenizer, **ARGS) for _ in range(2)]

    def work(rank):
        world.attach(ranks[rank], rank)
        results[rank] = evaluate(ranks[rank], ["tiny_mc"], eval_files)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[1] is None  # only rank 0 reports
    ours = {s["doc_id"]: s["resps"] for s in results[0]["samples"]["tiny_mc"]}
    assert ours == {s["doc_id"]: s["resps"] for s in res["samples"]["tiny_mc"]}  # each document ran on one rank
    assert results[0]["results"]["tiny_mc"]["acc,none"] == res["results"]["tiny_mc"]["acc,none"]


class _NoMaskTokenizer:
    eod_id, mask_id, pad_id, source_dir = 0, None, None, None

    def encode(self, text):
        return [3 + b % 100 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_bad_inputs_are_one_line_errors(eval_files):
    src = dict(load=str(eval_files["dlm"]), device="cpu")
    with pytest.raises(ConfigError, match="mc_num=0 must be a positive integer"):
        MegaDLMsLM(**src, mc_num=0)
    with pytest.raises(ConfigError, match="gen_length=10 is not divisible by block_length=4"):
        MegaDLMsLM(**src, gen_length=10, block_length=4)
    with pytest.raises(ConfigError, match="greedy='maybe' is not one of"):
        MegaDLMsLM(**src, greedy="maybe")
    model = eval_files["models"]["dlm"]
    model.config.mask_token_id = None
    try:
        lm = MegaDLMsLM(model=model, tokenizer=_NoMaskTokenizer(), device="cpu")
        with pytest.raises(ConfigError, match=r"needs its \[MASK\] id.*pass mask_token=ID"):
            lm.loglikelihood(_reqs([("a", "b")]))
    finally:
        model.config.mask_token_id = 1


def test_chat_template_from_the_tokenizer_folder(eval_files, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(default_tokenizer_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = eval_files["models"]["dlm"]
    lm = MegaDLMsLM(model=model, tokenizer=str(folder), device="cpu")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert lm.apply_chat_template(chat) == "<|system|>Be brief.<|endoftext|><|user|>Hi<|endoftext|><|assistant|>"
    assert lm.apply_chat_template(chat, add_generation_prompt=False).endswith("Hi<|endoftext|>")
    plain = MegaDLMsLM(model=model, tokenizer=str(default_tokenizer_path()), device="cpu")
    with pytest.raises(ConfigError, match="has no chat_template"):
        plain.apply_chat_template(chat)


def test_fp8_checkpoint_keeps_its_fp8_layers(eval_files, tmp_path):
    from megadlms.build import build_model
    from megadlms.fp8 import fp8_modules
    from megadlms.training.checkpoint import save_model_checkpoint

    bf16 = eval_files["models"]["dlm"]
    cfg = type(bf16.config).from_dict({**bf16.config.to_dict(), "fp8": True})
    fp8 = build_model(cfg)
    fp8.load_state_dict(bf16.state_dict(), strict=False)  # same weights; FP8 state starts fresh
    save_model_checkpoint(tmp_path / "fp8", fp8, cfg, tokenizer_dir=default_tokenizer_path())
    lm = MegaDLMsLM(load=str(tmp_path / "fp8"), **{**ARGS, "greedy": "off"})
    assert len(list(fp8_modules(lm.model))) > 0
    ref = MegaDLMsLM(model=bf16, tokenizer=lm.tokenizer, **{**ARGS, "greedy": "off"})
    pairs = [("The cat sat", " on the mat"), ("Tom", " had a toy")]
    got, want = lm.loglikelihood(_reqs(pairs)), ref.loglikelihood(_reqs(pairs))
    assert [g for g, _ in got] == pytest.approx([w for w, _ in want], rel=0.05)  # FP8 rounding only
    assert [g for g, _ in got] != [w for w, _ in want]


def test_long_contexts_lose_their_oldest_tokens(eval_files):
    lm = MegaDLMsLM(load=str(eval_files["dlm"]), **{**ARGS, "greedy": "off"})
    context = " ".join(f"word{i}" for i in range(80))  # far beyond max_position_embeddings=48
    ctx, cont = lm._encode_pair(context, " end")
    assert len(ctx) + len(cont) > 48
    got = lm.loglikelihood(_reqs([(context, " end")]))[0][0]
    kept = ctx[-(48 - len(cont)):]
    assert got == pytest.approx(lk.mc_loglikelihood(lm.model, [(kept, cont)], mask_id=1, mc_num=3, seed=1234)[0],
                                rel=1e-5)
    out = lm.generate_until(_reqs([(context, {"until": ["\n"]})], "generate_until"))
    assert len(out) == 1 and isinstance(out[0], str)
