"""Evaluation: likelihoods and perplexity bounds of DLMs (`likelihood`, `validation`), the lm-evaluation-harness
model class (`harness`), training curves (`plot`). The commands on top: `megadlms.cli.eval`, `megadlms.cli.plot`.

`harness` and `plot` import optional extras (lm_eval, matplotlib) when used; the rest needs none.
"""
