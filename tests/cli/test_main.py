"""`megadlms` without a command lists the commands and starts no run."""

from megadlms import cli


def test_a_bare_megadlms_prints_the_commands_and_trains_nothing(capsys, monkeypatch):
    monkeypatch.setattr(cli, "run_command", lambda *a, **k: 1 / 0)  # no command may run
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("megadlms {train,preprocess,generate,") and "  train        pre-train" in out
    assert out.rstrip().endswith("`megadlms train` with no flags trains the demo (`make demo`)")
    assert cli.main(["--help"]) == 0 and capsys.readouterr().out == out
