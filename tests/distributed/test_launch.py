"""The launcher of the distributed tests reruns a model-comparing worker once when a rank died in native code,
and never when a rank failed with a Python error."""

import pytest

from .launch import launch

WORKER = "tests/distributed/crash_probe_worker.py"


def test_a_native_crash_is_rerun_once_with_a_warning(tmp_path):
    stale = tmp_path / "first_attempt"  # what the first attempt left: removed before the rerun
    stale.mkdir()
    (stale / "metrics.jsonl").write_text("{}\n")
    with pytest.warns(UserWarning, match="died in native code; running it once more"):
        launch(2, [str(tmp_path / "marker"), "native"], script=WORKER, rerun_after_native_crash=True,
               clean_before_rerun=[stale], timeout=300)
    assert not stale.exists()


def test_without_the_option_or_after_a_python_error_it_fails(tmp_path):
    with pytest.raises(AssertionError, match="SIGABRT"):
        launch(2, [str(tmp_path / "a"), "native"], script=WORKER, timeout=300)
    with pytest.raises(AssertionError, match="a Python error"):
        launch(2, [str(tmp_path / "b"), "python"], script=WORKER, rerun_after_native_crash=True, timeout=300)
