"""Shared tiny checkpoints (bundled tokenizer) and local harness tasks over jsonl files: no download."""

import json
import os

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.data import default_tokenizer_path
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import save_model_checkpoint

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files: never ask the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = {
    "tiny_mc": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]},
    "tiny_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                 "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                 {"metric": "bits_per_byte"}]},
    "tiny_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                 "generation_kwargs": {"until": ["\n", "."], "do_sample": False},
                 "metric_list": [{"metric": "exact_match"}]},
}
DOCS = {
    "tiny_mc": [{"context": "The cat sat on the", "choices": [" mat", " moon and the stars"], "label": 0},
                {"context": "Once upon a time", "choices": [" there was", " a dog"], "label": 1}],
    "tiny_ppl": [{"text": "Lily saw a big red ball in the park."}, {"text": "Tom had a toy car. " * 4}],
    "tiny_gen": [{"question": "Q: Who was happy?\nA:", "answer": " Lily"}, {"question": "Tom said", "answer": " hi"}],
}


def tiny_config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=4096, seq_length=48, init_method_std=0.2, mask_token_id=1)
    return TransformerConfig(**{**base, **kw})


def save_tiny(path, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    model = TransformerLM(cfg).eval()
    save_model_checkpoint(path, model, cfg, tokenizer_dir=default_tokenizer_path())
    return model


@pytest.fixture(scope="session")
def eval_files(tmp_path_factory):
    """{'dlm', 'ar', 'dlm2': checkpoint dirs, 'tasks': the task folder, 'models': the saved models}."""
    root = tmp_path_factory.mktemp("eval")
    models = {"dlm": save_tiny(root / "dlm"), "ar": save_tiny(root / "ar", attn_mask_type="causal"),
              "dlm2": save_tiny(root / "dlm2", seed=1)}
    tasks = root / "tasks"
    tasks.mkdir()
    for name, spec in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[name]))
        yaml = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **spec}
        (tasks / f"{name}.yaml").write_text(json.dumps(yaml))  # JSON is YAML
    return {**{k: root / k for k in models}, "tasks": tasks, "models": models, "root": root}
