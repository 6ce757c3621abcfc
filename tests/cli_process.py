"""Command-line runs for the tests, without paying the interpreter's imports each time.

A test that runs `python recipes/train.py ...` gets the real thing: the script runs as
`__main__` with that command line, Hydra parses it, and the run is its own process with its
own environment, working directory, output and exit code. What differs from a fresh
interpreter is where the process comes from: it is forked from a server process that has
already imported torch, PEFT, diffusers and omni (about 8 s of a fresh interpreter's start,
a third of a short training run). The server never computes (no OpenMP or other threads to
inherit); each run sets its torch threads from its `OMP_NUM_THREADS` as a fresh interpreter
would, and runs the exit handlers a fresh interpreter runs.

`OMNI_TEST_FRESH_PROCESSES=1` runs each command in a fresh interpreter instead (a fresh
process also draws its own string-hash seed; a forked one shares the server's).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a training run imports before its first step (and this module, the forked target)
PRELOAD = ["torch", "peft", "diffusers.models.transformers", "omni.cli", "tests.cli_process"]
FRESH_ENV = "OMNI_TEST_FRESH_PROCESSES"


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once this test process's server runs
    return context


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter reports it
    return 1


def _run_script(argv: list, env: dict, cwd: str, out_path: str, err_path: str) -> None:
    """The body of a forked run: `python argv[0] argv[1:]` in `cwd` with `env`."""
    import runpy

    import torch

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out if err_path == out_path else os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` puts it first
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class Run:
    """One command started in the background: `finish(timeout)` waits and gives what
    subprocess.run gives (returncode, stdout, stderr; stderr None when merged into stdout);
    `communicate` and `returncode` read as subprocess.Popen's do."""

    def __init__(self, argv, *, cwd=REPO, env=None, merge_stderr=False):
        self.argv = [str(a) for a in argv]
        env = dict(os.environ if env is None else env)
        self._dir = tempfile.mkdtemp(prefix="omni-cli-")
        self._out = os.path.join(self._dir, "stdout")
        self._err = self._out if merge_stderr else os.path.join(self._dir, "stderr")
        self.returncode = None
        if os.environ.get(FRESH_ENV) == "1":
            with open(self._out, "w") as out, open(self._err, "a") as err:
                stderr = subprocess.STDOUT if merge_stderr else err  # one descriptor, one offset
                self._process = subprocess.Popen(
                    [sys.executable, *self.argv], cwd=cwd, env=env, stdout=out, stderr=stderr
                )
        else:
            self._process = _context().Process(
                target=_run_script, args=(self.argv, env, str(cwd), self._out, self._err), daemon=False
            )
            self._process.start()

    def _wait(self, timeout):
        if isinstance(self._process, subprocess.Popen):
            try:
                return self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
                raise
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self._process.exitcode

    def communicate(self, timeout=None) -> tuple:
        result = self.finish(timeout)
        return result.stdout, result.stderr

    def finish(self, timeout=None) -> subprocess.CompletedProcess:
        self.returncode = self._wait(timeout)
        stdout = Path(self._out).read_text(errors="replace")
        stderr = None if self._err == self._out else Path(self._err).read_text(errors="replace")
        for path in {self._out, self._err}:
            os.remove(path)
        os.rmdir(self._dir)
        return subprocess.CompletedProcess(self.argv, self.returncode, stdout, stderr)


def run(argv, *, cwd=REPO, env=None, timeout=None) -> subprocess.CompletedProcess:
    """`subprocess.run([python, *argv], capture_output=True, text=True)`, forked as above."""
    return Run(argv, cwd=cwd, env=env).finish(timeout)
