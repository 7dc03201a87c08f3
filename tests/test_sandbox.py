"""The ``python`` tool's sandbox (``minihf.multi_turn.sandbox``), tried as a hostile model
would: every escape of issue 57's probe runs through the real tool, and each test asserts
the caller survives, nothing outside the sandbox changed, and no process is left.

The isolated cases need Linux namespaces (``unshare``; root or unprivileged user
namespaces): CI's hosts have them; elsewhere those tests skip, naming why.
"""

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from minihf.multi_turn import sandbox
from minihf.multi_turn.sandbox import run_python
from minihf.multi_turn.tools import ToolEnvironment
from minihf.workers.config import MultiTurnConfig

MISSING = sandbox.isolation_missing()
isolated = pytest.mark.skipif(MISSING is not None, reason=f"no namespaces here: {MISSING}")


def _processes_with(marker: str) -> list[int]:
    """Host processes whose command line holds ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def run(code: str, **limits) -> str:
    """``code`` through the tool, timed: every call returns within its wall limit + 5 s."""
    t0 = time.monotonic()
    out = run_python(code, mode="isolated", **{"wall_s": 5.0, "cpu_s": 2, **limits})
    assert time.monotonic() - t0 < limits.get("wall_s", 5.0) + 5, out[:200]
    return out


def test_ci_runs_the_isolated_cases():
    if os.environ.get("MINIHF_REQUIRE_NAMESPACES"):  # set by .ci/run
        assert MISSING is None, f"this CI host cannot run the isolated sandbox: {MISSING}"


# -- the limits (both modes) -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["isolated", "process"])
@pytest.mark.parametrize("code,expect", [
    ("print(6 * 7)", "42\n"),
    ("while True: pass", "error: it used more than 1 s of CPU"),
    ("import time\ntime.sleep(60)", "error: the code ran past 3.0 s and was stopped"),
    ("import os\nwhile True: os.fork()", "error: PermissionError: the python tool does not allow os.fork"),
    ("x = bytearray(10 * 1024 ** 3)", "error: MemoryError"),
    ("import faulthandler\nfaulthandler._sigsegv()", "error: it died of SIGSEGV"),
    ("while True: print('x' * 1000)", "error: the code printed more than 65536 bytes and was stopped"),
    ("import signal\nsignal.raise_signal(signal.SIGRTMIN + 6)", "error: it died of signal"),  # was a ValueError
    ("import sys\nsys.exit(3)", "error: exit status 3"),
    ("import os\nprint(sorted(os.environ))",
     "['HOME', 'LC_CTYPE', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH']\n"),
], ids=["ok", "loop", "sleep", "fork_bomb", "10GB", "segfault", "flood", "rt_signal", "exit", "env"])
def test_limits_end_as_observations(mode, code, expect):
    if mode == "isolated" and MISSING:
        pytest.skip(MISSING)
    t0 = time.monotonic()
    out = run_python(code, mode=mode, wall_s=3.0, cpu_s=1)
    assert out.startswith(expect), out[:200]
    assert time.monotonic() - t0 < 10
    assert len(out) < 70_000  # the output cap holds, whatever was printed


# -- the escapes of the probe, isolated ----------------------------------------------------

@isolated
def test_the_trainers_environment_is_out_of_sight(monkeypatch):
    secret = f"minihf-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("MINIHF_TEST_SECRET", secret)
    out = run("import os\nfound = []\n"
              "for p in os.listdir('/proc'):\n"
              "    try: found.append(open(f'/proc/{p}/environ', 'rb').read())\n"
              "    except Exception: pass\n"
              "print(os.getppid(), len(found), b''.join(found)[:100000])")
    assert secret not in out, out[:300]
    assert out.startswith("1 "), out[:300]  # its parent: the namespace's first process, not the trainer


@isolated
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    out = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert out.startswith("error:") and "connected" not in out, out
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


@isolated
def test_no_file_outside_is_read_or_written(tmp_path):
    mine = tmp_path / "checkpoint.bin"
    mine.write_bytes(b"weights")
    target = tmp_path / "written.txt"
    out = run(f"import os\n"
              f"for p in [{str(mine)!r}, '/proc/1/root{mine}', '/proc/1/cwd/README.md', '/proc/1/environ']:\n"
              f"    try: print('read', open(p, 'rb').read()[:10])\n"
              f"    except OSError as e: print('no', type(e).__name__)\n"
              f"for p in [{str(target)!r}, '/usr/minihf-x', '/etc/minihf-x', '/minihf-x']:\n"
              f"    try: open(p, 'w').write('x'); print('wrote', p)\n"
              f"    except OSError as e: print('no', type(e).__name__)\n")
    assert "read" not in out and "wrote" not in out, out
    assert mine.read_bytes() == b"weights" and sorted(os.listdir(tmp_path)) == ["checkpoint.bin"]


@isolated
def test_the_writable_tmp_is_private_and_capped():
    marker = uuid.uuid4().hex
    out = run(f"import os\nn = 0\n"
              f"try:\n"
              f"    while True:\n"
              f"        open(f'/tmp/{marker}-{{n}}', 'wb').write(b'x' * (1 << 20)); n += 1\n"
              f"except OSError as e: print(n, e.errno)\n")
    written, errno = map(int, out.split())
    assert written <= 16 and errno == 28, out  # ENOSPC at the 16 MB cap, not 94 MB
    assert not [p for p in os.listdir("/tmp") if p.startswith(marker)]
    # 3000 nested directories: the tmpfs goes with the namespace, no clean-up to break
    before = set(os.listdir("/tmp"))
    out = run("import os\nos.chdir('/tmp')\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')")
    assert out == "deep\n", out
    assert "d" not in set(os.listdir("/tmp")) - before  # (other tests' files may come meanwhile)


BYPASS = """import subprocess, sys
sys.audit = lambda *args: None  # subprocess reads sys.audit by name: the hook never hears of it
subprocess._USE_POSIX_SPAWN = False  # 3.13 would spawn by os.posix_spawn, audited in C: fork instead
subprocess.Popen(['/bin/sh', '-c', 'sleep 60 # {marker}'], start_new_session=True)
subprocess.run(['/bin/sh', '-c', 'touch {path}; echo $$ > /tmp/pid'])
print('started')
"""


@isolated
@pytest.mark.parametrize("then", ["ends", "times out"])
def test_processes_past_the_audit_hook_die_with_the_call(tmp_path, then):
    marker = f"minihf-orphan-{uuid.uuid4().hex}"
    code = BYPASS.format(marker=marker, path=tmp_path / "pwned")
    out = run(code + ("import time\ntime.sleep(60)\n" if then == "times out" else ""), wall_s=3.0)
    assert out == ("started\n" if then == "ends" else "error: the code ran past 3.0 s and was stopped"), out
    time.sleep(0.3)
    assert not _processes_with(marker), out  # a new session, yet the namespace's processes died with it
    assert not (tmp_path / "pwned").exists(), out


@isolated
def test_no_signal_reaches_the_caller():
    witness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # targets: its parent and two host processes by number (the test's, a witness); not
        # every pid it sees, which, with isolation broken, would take the whole host down
        out = run("import os, signal\n"
                  "hits = []\n"
                  f"for p in [os.getppid(), {os.getpid()}, {witness.pid}]:\n"
                  "    try: signal.pidfd_send_signal(os.pidfd_open(p), signal.SIGKILL); hits.append(p)\n"
                  "    except Exception: pass\n"
                  "print('hits', hits)")
        assert witness.poll() is None, out  # the host's processes are out of reach
    finally:
        witness.kill()
        witness.wait()
    assert out == "hits []\n", out  # its parent is root's: not even that one


@isolated
def test_closed_or_held_output_cannot_block_the_caller():
    out = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", wall_s=2.0)
    assert out == "error: the code ran past 2.0 s and was stopped", out
    out = run("import shutil, sys\nshutil.copyfileobj(open('/dev/zero', 'rb'), sys.stdout.buffer)")
    assert out.startswith("error: the code printed more than 65536 bytes"), out[:100]


@isolated
def test_runs_without_privileges():
    out = run("print(open('/proc/self/status').read())")
    fields = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
    assert fields["NoNewPrivs"].strip() == "1" and int(fields["CapEff"], 16) == 0, out
    if os.geteuid() == 0:  # a uid of the call's own, no account's
        assert int(fields["Uid"].split()[0]) >= sandbox.UID_BASE, out


@isolated
def test_concurrent_calls_do_not_share_a_process_limit():
    """As root every call ran as nobody, and the kernel counts RLIMIT_NPROC per uid: with
    nine calls sleeping, a tenth could not start a thread (a tool's result depended on its
    batch-mates). Each call in flight now has a uid of its own."""
    import threading

    spawn = "import threading\nt = threading.Thread(target=print, args=('thread ran',))\nt.start()\nt.join()"
    sleepers = [threading.Thread(target=run, args=("import time\ntime.sleep(3)",)) for _ in range(9)]
    for t in sleepers:
        t.start()
    time.sleep(1.5)
    try:
        assert run(spawn).strip() == "thread ran"
    finally:
        for t in sleepers:
            t.join()


# -- the caller's side ---------------------------------------------------------------------

def test_an_error_observation_is_cut_like_any_other():
    def shout(code: str) -> str:
        """Print.

        Args:
            code: the program
        """
        return "error: " + "x" * 60_000

    env = ToolEnvironment({}, {"shout": shout}, max_response_length=256)
    obs, _, _ = env.step('<tool_call>{"name": "shout", "arguments": {"code": "1"}}</tool_call>')
    assert len(obs[0]["content"]) == 256 + len("...(truncated)") and env.tool_errors == 1


def test_config_bounds_a_turns_tools_by_the_environment_timeout():
    with pytest.raises(ValueError, match=r"max_parallel_calls x tool_timeout_s = 4 x 30.0 s.*env_timeout_s=120"):
        MultiTurnConfig(enable=True, tools=["python"], max_parallel_calls=4)
    MultiTurnConfig(enable=True, tools=["python"], max_parallel_calls=3)
    with pytest.raises(ValueError, match="sandbox='docker'"):
        MultiTurnConfig(enable=True, tools=["python"], sandbox="docker")


def test_without_namespaces_the_tool_refuses_unless_told(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_missing", lambda: "the 'unshare' command is not installed")
    with pytest.raises(ValueError, match=r"cannot: the 'unshare' command.*rollout.multi_turn.sandbox=process"):
        sandbox.check("isolated")
    sandbox.check("process")  # the weaker mode, accepted knowingly
    with pytest.raises(ValueError, match="sandbox='vm'"):
        sandbox.check("vm")
    with pytest.raises(ValueError, match="run_python.mode='vm'"):
        run_python("print(1)", mode="vm")


def test_process_mode_leaves_no_directory(tmp_path, monkeypatch):
    import glob
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's own: others run alongside
    before = set(glob.glob(f"{tempfile.gettempdir()}/minihf-python-*"))
    assert run_python("open('f', 'w').write('x'); print('ok')", mode="process") == "ok\n"
    deep = "import os\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    assert run_python(deep, mode="process") == "deep\n"  # past shutil.rmtree's recursion
    assert set(glob.glob(f"{tempfile.gettempdir()}/minihf-python-*")) == before


def test_the_code_reward_of_the_docs_runs_as_written():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "multi-turn.md").read_text()
    block = re.search(r"### A reward that runs model-written code.*?```python\n(.*?)```", doc, re.S).group(1)
    mode = "isolated" if MISSING is None else "process"
    env = dict(os.environ, PYTHONPATH=str(Path(sandbox.__file__).resolve().parents[2]))
    code = f"from minihf.multi_turn import sandbox\nsandbox._mode = {mode!r}\n" + block
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout == "1.0\n0.0\n0.0\n0.0\n", (res.stdout, res.stderr[-2000:])


def test_bench_sandbox_runs():
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_sandbox.py"
    res = subprocess.run([sys.executable, str(script), "--rounds", "2"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| process | " in res.stdout and ("| isolated | " in res.stdout or MISSING), res.stdout


# -- code RL: the chat_code task and the grpo_smollm2_code recipe --------------------------

def test_chat_code_scores_code_by_its_tests(monkeypatch):
    import random

    from minihf.data.tasks import chat_code

    rng = random.Random(0)
    for _ in range(6):
        prompt, tests, answer, params = chat_code.make_example(rng)
        assert params["function"] in prompt and tests.count("assert ") == chat_code.TESTS
        assert chat_code.compute_score(answer, tests) == 1.0
        fenced = f"Here it is:\n```python\n{answer}\n```\nIt returns the value."
        assert chat_code.compute_score(fenced, tests) == 1.0
        cut = f"Sure!\n```python\n{answer}\n"  # the length limit came before the closing fence
        assert chat_code.compute_score(cut, tests) == 1.0
        wrong = answer.replace("return", "return 1 + ")
        assert chat_code.compute_score(wrong, tests) == 0.0
    assert chat_code.compute_score("import os\nos.system('true')", tests) == 0.0
    # leaving before the asserts with the old marker printed: it earned 1.0
    assert chat_code.compute_score(f"{wrong}\nprint('passed')\nraise SystemExit", tests) == 0.0
    assert chat_code.compute_score(f"{answer}\nprint('passed')\nimport os\nos._exit(0)", tests) == 0.0
    # without namespaces: the reward stops the run naming the setting, unless it is given
    monkeypatch.setattr(sandbox, "isolation_missing", lambda: "the 'unshare' command is not installed")
    with pytest.raises(ValueError, match="sandbox=process"):
        chat_code.compute_score(answer, tests)
    monkeypatch.setenv("MINIHF_SANDBOX", "process")
    assert chat_code.compute_score(answer, tests) == 1.0


def test_the_code_recipe_runs_a_step(tmp_path, monkeypatch):
    """grpo_smollm2_code on a tiny char model of the task (the recipe's SmolLM2 is not on CI's
    disk): one GRPO step and a validation, each sample's code run in the sandbox."""
    import minihf
    from minihf.data import make_task_data
    from minihf.hub import init_model

    monkeypatch.chdir(tmp_path)
    if MISSING:
        monkeypatch.setenv("MINIHF_SANDBOX", "process")
    init_model("m", size="tiny", task="chat_code")
    make_task_data("chat_code", "d", 16, 4)
    result = minihf.train("grpo_smollm2_code", [
        "prepare.gguf_file=null", "prepare.task=null", "actor_rollout_ref.model.path=m",
        "data.train_files=d/train.parquet", "data.val_files=d/test.parquet", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_prompt_length=160", "trainer.total_training_steps=1", "actor_rollout_ref.rollout.val_kwargs.n=1"])
    last = result.history[-1]
    assert last["step"] == 1 and "val-core/minihf/chat_code/reward/mean@1" in last, sorted(last)
