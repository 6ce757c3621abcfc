"""tests/cli_process.py runs a script as `python script.py args` would: its command line,
environment, working directory, torch threads, separate or merged output, exit code (from
sys.exit, an exception or a signal) and exit handlers."""

import os
import subprocess
import textwrap

import pytest

from tests import cli_process

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    import torch
    atexit.register(lambda: print("exit handler ran", flush=True))
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "flag", os.environ.get("FLAG"), "threads", torch.get_num_threads())
    print("to stderr", file=sys.stderr)
    print("main" if __name__ == "__main__" else "imported")
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("boom")
    if how == "kill":
        os.kill(os.getpid(), 9)
    sys.exit({"ok": 0, "code": 3, "message": "stopped: bad key"}[how])
    """
)


@pytest.fixture(params=["forked", "fresh"])
def script(request, tmp_path, monkeypatch):
    if request.param == "fresh":
        monkeypatch.setenv(cli_process.FRESH_ENV, "1")
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def test_a_run_gets_its_command_line_environment_directory_and_threads(script, tmp_path):
    env = {**os.environ, "FLAG": "on", "OMP_NUM_THREADS": "2"}
    result = cli_process.run([script, "ok", "x=1"], cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"argv ['ok', 'x=1'] cwd {tmp_path} flag on threads 2" in result.stdout
    assert "main" in result.stdout.splitlines() and "exit handler ran" in result.stdout
    assert result.stderr.strip() == "to stderr"


@pytest.mark.parametrize(
    "how, code, stderr", [("code", 3, ""), ("message", 1, "stopped: bad key"), ("raise", 1, "ValueError: boom")]
)
def test_a_failing_run_gives_its_exit_code_and_message(script, how, code, stderr):
    result = cli_process.run([script, how], timeout=120)
    assert result.returncode == code and stderr in result.stderr
    assert "exit handler ran" in result.stdout


def test_a_killed_run_reads_as_subprocess_reports_it(script):
    assert cli_process.run([script, "kill"], timeout=120).returncode == -9


def test_merged_output_and_a_timeout(script, tmp_path):
    run = cli_process.Run([script, "ok"], merge_stderr=True)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0 and err is None and "to stderr" in out and "argv" in out
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        cli_process.run([sleeper], timeout=1)


def test_a_forked_run_starts_with_one_thread(tmp_path):
    """The server only imported: a forked run inherits no thread (an OpenMP pool included)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import threading\nprint('threads', threading.active_count())\n")
    result = cli_process.run([probe], timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["threads", "1"], result.stdout + result.stderr
