"""Evaluation: likelihoods and perplexity bounds of DLMs, the lm-evaluation-harness model class (`harness`),
`megadlms eval` and `megadlms plot`.

`harness` and the commands import optional extras (lm_eval, matplotlib) when used; `likelihood` needs none.
"""
