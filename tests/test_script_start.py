"""A script's start as a user sees it under torchrun: an error at start-up reported once, a
config error in one line, ``--help`` that starts nothing, Ctrl-C while torch imports."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_controller_launch import ROOT, TORCHRUN, _run


START_ERROR = """
import os, sys, time
from minihf.controller.launch import run_script

def main(argv):
    rank = int(os.environ["RANK"])
    if rank == 0 and argv[0] == "slow":      # rank 0 reaches the shared error last
        time.sleep(2)
    if rank == 0 and argv[0] == "alone":     # only rank 1 fails; rank 0 would wait for it
        time.sleep(120)
    raise ValueError(f"bad value on rank {rank}; use another")

run_script(main, sys.argv[1:])
"""


@pytest.mark.parametrize("case", ["slow", "alone"])
def test_start_up_errors_of_scripts_are_reported_once(case, tmp_path):
    """An error every rank hits is reported once, by rank 0, even when rank 1 gets there
    first (it waits for rank 0); an error of one rank only is reported by that rank."""
    script = tmp_path / "start.py"
    script.write_text(START_ERROR)
    job = _run(TORCHRUN + [str(script), case], timeout=60)
    assert job.returncode not in (0, None), job.log
    reports = [line for line in job.stderr.splitlines() if line.startswith("[minihf]")]
    want = ("[minihf] job failed: ValueError: bad value on rank 0; use another" if case == "slow"
            else "[minihf] rank 1: job failed: ValueError: bad value on rank 1; use another")
    assert reports == [want], job.log
    assert job.elapsed < 30, job.log  # "alone": ended by rank 1's exit, not rank 0's sleep


def test_script_config_error_is_one_line_from_rank_zero():
    job = _run(TORCHRUN + ["scripts/train_ppo.py", "algorithm.adv_estimatr=gae"])
    assert job.returncode not in (0, None), job.log
    assert job.stderr.count("job failed: ConfigError: unknown key 'algorithm.adv_estimatr'; "
                            "did you mean 'adv_estimator'?") == 1, job.log
    # a traceback frame of minihf's own code (the package or the scripts), matched by
    # directory: torchrun's own report of the failed child has a traceback, and its frames
    # under site-packages may contain "minihf" too (a virtualenv named minihf)
    import minihf

    own = (str(Path(minihf.__file__).resolve().parent), str(ROOT / "scripts"))
    ours = [line for line in job.stderr.splitlines()
            if line.strip().startswith('File "') and line.split('"')[1].startswith(own)]
    assert not ours, job.log


@pytest.mark.parametrize("script", ["train_ppo.py", "train_sft.py", "train_rm.py"])
def test_scripts_print_help_and_start_nothing(script, tmp_path, monkeypatch, capsys):
    """``--help`` prints the script's docstring and where the keys are explained and starts
    no job (the run dir is not created); under torchrun rank 0 alone prints it, exit 0."""
    import runpy

    run_dir = tmp_path / "run"
    path = ROOT / "scripts" / script
    first = path.read_text().split('"""')[1].strip().splitlines()[0]
    monkeypatch.setattr(sys, "argv", [str(path), "--help", f"trainer.default_local_dir={run_dir}"])
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith(first) and "docs/config.md" in out, out
    assert not run_dir.exists()
    if script == "train_ppo.py":
        job = _run(TORCHRUN + [str(path), "-h"], timeout=120)
        assert job.returncode == 0 and job.stdout.count(first) == 1, job.log


CTRL_C_WHILE_IMPORTING = """
import os, signal, sys, time
import minihf.utils.script_start  # as the scripts do, first
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the imports below would run
time.sleep(float(sys.argv[1]))
print("still here")
"""


def _with_sigint(disposition):
    """A child's SIGINT as its shell would leave it: the default in a terminal's foreground
    job; ignored in a background job of a non-interactive shell (`bash -c 'cmd &'`, nohup,
    many job runners), which this suite itself may be, so the child sets it, not inherits it."""
    return lambda: signal.signal(signal.SIGINT, disposition)


def test_ctrl_c_while_a_script_imports_is_one_line():
    """A script's first seconds import torch: Ctrl-C there is one line, not an import
    traceback per rank; once the job starts (run_script), Ctrl-C is Python's again. A SIGINT
    the script was started with ignored (a background job) stays ignored."""
    res = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING, "30"], capture_output=True, text=True,
                         timeout=60, preexec_fn=_with_sigint(signal.SIG_DFL))
    assert res.returncode == 130 and res.stderr == "[minihf] interrupted (SIGINT) while starting; nothing was written\n"
    res = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING, "0.2"], capture_output=True, text=True,
                         timeout=60, preexec_fn=_with_sigint(signal.SIG_IGN))
    assert res.returncode == 0 and res.stdout == "still here\n", res
    from minihf.controller.launch import run_script
    from minihf.utils import process_exit

    previous = signal.signal(signal.SIGINT, process_exit._quit)
    try:
        run_script(lambda argv: None, [])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    for script in ("train_ppo.py", "train_sft.py", "train_rm.py"):
        assert "import minihf.utils.script_start" in (ROOT / "scripts" / script).read_text().split("from minihf")[0]
