"""`megadlms eval`'s tests use the evaluation tests' tiny checkpoints and local harness tasks."""

from tests.eval.conftest import eval_files  # noqa: F401 (a fixture)
