"""RL records: the jsonl formats, one-line errors naming the record, the resumable loader."""

import json

import pytest

from megadlms.config import ConfigError
from megadlms.data import load_tokenizer
from megadlms.rl.data import RecordError, RecordLoader, read_pairs, read_prompts
from megadlms.training.config import RLConfig

TOK = load_tokenizer(None)


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pairs_are_tokenized_with_eod_after_each_response(tmp_path):
    recs = read_pairs(write(tmp_path / "p.jsonl", [{"prompt": "Q: a", "chosen": "b", "rejected": "c d"}]), TOK)
    assert recs[0].prompt == TOK.encode("Q: a")
    assert recs[0].chosen == TOK.encode("b") + [TOK.eod_id] and recs[0].rejected[-1] == TOK.eod_id


@pytest.mark.parametrize("record, message", [
    ({"prompt": "a", "chosen": "b"}, r"p.jsonl:2 has no 'rejected' field \(it has \['chosen', 'prompt'\]\)"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, r"p.jsonl:2: 'chosen' must be a non-empty string"),
])
def test_a_bad_pair_is_named(tmp_path, record, message):
    path = write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, record])
    with pytest.raises(RecordError, match=message):
        read_pairs(path, TOK)


def test_a_prompt_without_the_rewards_field_is_named(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    assert len(read_prompts(path, TOK)) == 2
    with pytest.raises(RecordError, match=r"q.jsonl:2 has no 'answer' field, which its reward reads"):
        read_prompts(path, TOK, ("answer",))


def test_the_loader_resumes_where_it_stopped():
    recs = list(range(10))
    loader = RecordLoader(recs, micro_batch_size=3, seed=1)  # type: ignore[arg-type]
    it = iter(loader)
    first = [next(it) for _ in range(5)]  # crosses an epoch
    assert sorted(sum(first[:4], [])[:10]) == recs  # the first epoch is a permutation
    state = loader.state_dict()
    more = [next(it) for _ in range(3)]
    again = RecordLoader(recs, micro_batch_size=3, seed=1)  # type: ignore[arg-type]
    again.load_state_dict({**state, "consumed_samples": 999})  # the trainer's count is not the loader's
    it2 = iter(again)
    assert [next(it2) for _ in range(3)] == more
    # two ranks split each global micro-batch
    r0, r1 = (iter(RecordLoader(recs, micro_batch_size=3, dp_rank=r, dp_size=2, seed=1)) for r in (0, 1))  # type: ignore[arg-type]
    assert next(r0) + next(r1) == first[0] + first[1]


@pytest.mark.parametrize("make, message", [
    (lambda: RLConfig(rl="vrpo"), "--rl vrpo needs --rl-data FILE.jsonl"),
    (lambda: RLConfig(rl_data="x.jsonl"), "--rl-data x.jsonl is set but --rl is not"),
    (lambda: RLConfig(rl="grpo", rl_data="x", grpo_group_size=1), "--grpo-group-size 1: group-normalised"),
    (lambda: RLConfig(rl="ppo", rl_data="x"), "--rl 'ppo' is not one of"),
    (lambda: RLConfig(rl="grpo", rl_data="x", rl_gen_length=10, rl_block_length=4), "must divide --rl-gen-length"),
])
def test_bad_settings_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_rl_without_lora_refuses_sharded_weights():
    from megadlms.config import TransformerConfig
    from megadlms.distributed.config import ParallelConfig
    from megadlms.training.config import RunConfig
    from megadlms.training.run_plan import RunPlan

    with pytest.raises(ConfigError, match="add --lora-rank R .the frozen base is the reference. or use no_shard"):
        RunPlan(RunConfig(rl=RLConfig(rl="vrpo", rl_data="x"),
                          parallel=ParallelConfig(data_parallel_sharding_strategy="optim_grads_params")),
                TransformerConfig(), world_size=2).check()
