"""Command-line inputs a tester broke by hand, each refused in one line with a non-zero exit
(docs/reliability.md):

* the run dir: a symlink loop, a path where nothing can be created (``/proc``), checked at
  start-up before any lock (``trainer.common.check_run_dir``; ``utils.locks`` says the same);
* lengths past the model's context: ``eval --max-tokens``, ``generate --max-model-len``;
* ``nan`` / ``inf`` for a float flag of ``generate`` and ``eval``;
* a broken or raising chat template under ``generate --chat`` (and ``eval``);
* ``eval``: characters outside the vocabulary (``--allow-unk`` as in ``generate``), a
  ``--reward`` name the file lacks, a ``--json`` that would overwrite a prompt file or
  another file, a row without a ground truth;
* ``plan``: an unwritable ``--out`` (checked before the search), ``--top`` < 1, an ``--out``
  that is not an earlier plan;
* ``export`` of a checkpoint whose ``meta.json`` is not an object; ``make-data`` and
  ``export`` into ``/proc``;
* an oversized recipe file, refused by its size before the YAML parse.

Everything runs in-process (typer's CliRunner) on a tiny model whose context is 64
positions, so the code before these checks fails fast instead of hanging.
"""

import json
import shutil
import time
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minihf.cli import app

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 64  # the tiny model's max_position_embeddings


def run(*args):
    """``minihf ARGS`` in this process: (exit code, the output flattened to one line)."""
    res = CliRunner().invoke(app, [str(a) for a in args])  # wide: conftest's wide_terminal
    flat = " ".join(res.output.replace("│", " ").replace("╭", " ").replace("╰", " ").split())
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        flat += f" [raised {type(res.exception).__name__}: {res.exception}]"
    return res.exit_code, flat


def refused(code: int, out: str, *needles: str) -> None:
    assert code == 2 and "Traceback" not in out and "[raised" not in out, out
    for needle in needles:
        assert needle in out, (needle, out)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny digits model with a 64-position context, its data, copies with a broken and
    a raising chat template, and a 1-step checkpoint of the model."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("cli_checks")
    init_model(root / "m", size="tiny", task="digits", max_position_embeddings=CONTEXT)
    make_task_data("digits", root / "data", 8, 4, seed=0)
    for name, template in (("broken", "{% for %}"), ("raising", "{{ raise_exception('no turns here') }}")):
        shutil.copytree(root / "m", root / name)
        (root / name / "chat_template.jinja").write_text(template)
    return root


def rows(root) -> list[dict]:
    return [json.loads(line) for line in (root / "data" / "test.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- run dir


def test_a_run_dir_that_cannot_be_resolved_or_created_is_one_line(root, tmp_path):
    from minihf.config import ConfigError
    from minihf.trainer.common import check_run_dir

    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    key = "trainer.default_local_dir"
    for bad in (tmp_path / "loopA", tmp_path / "loopA" / "run"):
        with pytest.raises(ConfigError, match=f"{key}=.*cannot be resolved .*[Ss]ymlink loop.*choose another"):
            check_run_dir(bad, key)
    with pytest.raises(ConfigError, match=r"/proc/minihf_run cannot be created or written: making an entry "
                                          r"in /proc fails \(No such file or directory\)"):
        check_run_dir(Path("/proc/minihf_run"), key)
    check_run_dir(tmp_path / "new" / "run", key)  # creatable: fine, and nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loopA", "loopB"]

    # through `minihf sft`: one line, exit 2, before any job starts
    base = ["sft", "sft_digits", f"model.path={root / 'm'}", f"data.train_files={root / 'data' / 'train.parquet'}",
            f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=8",
            "trainer.total_training_steps=1", f"data.max_length={CONTEXT}"]  # the recipe's 128 is past the context
    refused(*run(*base, f"{key}={tmp_path / 'loopA'}"), "cannot be resolved", "Symlink loop")
    refused(*run(*base[:-1], f"{key}={tmp_path / 'new'}"),
            f"data.max_length=128 exceeds the model's context, max_position_embeddings={CONTEXT}")
    refused(*run(*base, f"{key}=/proc/minihf_run"), "making an entry in /proc fails")


def test_the_lock_of_an_unresolvable_or_uncreatable_dir_is_one_line(tmp_path):
    from minihf.utils.locks import LockFileError, acquire, lock_path, release

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(LockFileError, match="cannot be resolved"):
        lock_path(tmp_path / "a")
    with pytest.raises(LockFileError, match=r"the run dir: cannot create its lock file /proc/\.x\.lock"):
        acquire("/proc/x", "the run dir", "fix")
    release(tmp_path / "a")  # never held: nothing to do, no error


# ---------------------------------------------------------------------------- lengths


def test_lengths_past_the_models_context_are_refused_naming_both(root):
    data = root / "data" / "test.jsonl"
    code, out = run("eval", root / "m", data, "-n", "1", "--max-tokens", "100")
    refused(code, out, "exceeds the model's context, max_position_embeddings=64", "+ 100", "lower --max-tokens")
    # the bound it names is the one that fits
    fits = int(out.split("lower --max-tokens to at most ")[1].split()[0])
    assert 0 < fits < CONTEXT
    code, out = run("eval", root / "m", data, "-n", "1", "--greedy", "--max-tokens", str(fits))
    assert code == 0, out
    # a prompt over --max-prompt-length: eval's own option, not the dataset's truncation key
    code, out = run("eval", root / "m", data, "-n", "1", "--max-tokens", "2", "--max-prompt-length", "3")
    refused(code, out, "longer than max_prompt_length=3; raise --max-prompt-length")
    assert "truncation" not in out, out
    refused(*run("eval", root / "m", data, "-n", "1", "--max-tokens", str(fits + 1)),
            "exceeds the model's context")  # and it is the largest that fits: one more is refused
    for args in (["--max-model-len", "100", "--max-tokens", "100"],
                 ["--max-model-len", "10000000000", "--max-tokens", "100000000"]):
        code, out = run("generate", root / "m", "-p", "123", *args)
        refused(code, out, f"--max-model-len {args[1]} exceeds the model's context, max_position_embeddings=64",
                "pass at most 64")
    refused(*run("generate", root / "m", "-p", "123", "--max-model-len", "-3"), "must be >= 1")
    code, out = run("generate", root / "m", "-p", "123", "--max-tokens", "100")  # capped by the context
    assert code == 0 and "[max_model_len]" in out, out


# ---------------------------------------------------------------------------- float flags


@pytest.mark.parametrize("command,flag,value", [
    ("generate", "--temperature", "nan"), ("generate", "--temperature", "inf"), ("generate", "--top-p", "nan"),
    ("eval", "--temperature", "nan"), ("eval", "--top-p", "-inf"), ("eval", "--pass-threshold", "nan"),
    ("eval", "--pass-threshold", "inf"),
])
def test_non_finite_float_flags_are_refused(root, command, flag, value):
    target = ["-p", "123"] if command == "generate" else [root / "data" / "test.jsonl", "-n", "1"]
    code, out = run(command, root / "m", *target, "--max-tokens", "2", flag, value)
    refused(code, out, f"{flag} {value}: must be a finite number")


def test_eval_config_refuses_non_finite_values():
    from minihf.trainer.evaluate import EvalConfig

    for key in ("temperature", "top_p", "pass_threshold"):
        with pytest.raises(ValueError, match=f"{key}=nan must be a finite number"):
            EvalConfig(**{key: float("nan")})


# ---------------------------------------------------------------------------- chat template


def test_a_broken_or_raising_chat_template_is_one_line_naming_the_file(root):
    code, out = run("generate", root / "broken", "-p", "12", "--chat", "--max-tokens", "2")
    refused(code, out, "the chat template of", "(chat_template.jinja) failed at line 1: TemplateSyntaxError")
    code, out = run("generate", root / "raising", "-p", "12", "--chat", "--max-tokens", "2")
    refused(code, out, "(chat_template.jinja) failed: TemplateError: no turns here")
    code, out = run("eval", root / "broken", root / "data" / "test.jsonl", "-n", "1", "--max-tokens", "2")
    refused(code, out, "row 0: the chat template failed", "chat_template.jinja of")


# ---------------------------------------------------------------------------- eval


def test_eval_refuses_unknown_characters_as_generate_does(root, tmp_path):
    row = rows(root)[0]
    row["prompt"] = [{"role": "user", "content": row["prompt"][0]["content"] + "x;"}]
    (tmp_path / "unk.jsonl").write_text(json.dumps(row) + "\n")
    code, out = run("eval", root / "m", tmp_path / "unk.jsonl", "-n", "1", "--max-tokens", "2")
    refused(code, out, "unk.jsonl, row 0: the prompt has characters outside the model's vocabulary: [';', 'x']",
            "pass --allow-unk")
    code, out = run("eval", root / "m", tmp_path / "unk.jsonl", "-n", "1", "--max-tokens", "2", "--allow-unk")
    assert code == 0 and "minihf/digits/greedy" in out, out


def test_eval_names_a_missing_reward_function_and_what_the_file_has(root, tmp_path):
    (tmp_path / "rw.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return 1.0\n")
    code, out = run("eval", root / "m", root / "data" / "test.jsonl", "--reward", f"{tmp_path / 'rw.py'}:nope")
    refused(code, out, "has no reward function 'nope'; names defined there: ['score']")


def test_eval_json_never_overwrites_a_prompt_file_or_a_foreign_file(root, tmp_path):
    data = tmp_path / "test.jsonl"
    shutil.copy(root / "data" / "test.jsonl", data)
    before = data.read_text()
    code, out = run("eval", root / "m", data, "-n", "1", "--max-tokens", "2", "--json", data)
    refused(code, out, "is one of the prompt files")
    notes = tmp_path / "notes.json"
    notes.write_text('{"my": "notes"}\n')
    code, out = run("eval", root / "m", data, "-n", "1", "--max-tokens", "2", "--json", notes)
    refused(code, out, "exists and does not hold metrics of `minihf eval`")
    assert data.read_text() == before and notes.read_text() == '{"my": "notes"}\n'
    metrics = tmp_path / "metrics.json"
    for _ in range(2):  # written, then replaced: earlier metrics are what --json is for
        code, out = run("eval", root / "m", data, "-n", "1", "--max-tokens", "2", "--json", metrics)
        assert code == 0 and json.loads(metrics.read_text())["prompts"] == 4, out


def test_eval_names_the_row_without_a_ground_truth(root, tmp_path):
    good, bad = rows(root)[:2]
    bad["reward_model"]["ground_truth"] = None
    (tmp_path / "null.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    del bad["reward_model"]
    (tmp_path / "missing.jsonl").write_text(json.dumps(bad) + "\n")
    for name, row in (("null.jsonl", 1), ("missing.jsonl", 0)):
        code, out = run("eval", root / "m", tmp_path / name, "-n", "1", "--max-tokens", "2")
        refused(code, out, f"{name}, row {row}: no ground truth (column 'reward_model' missing, or its "
                "ground_truth is null)")
    from minihf.data import default_reward_fn

    with pytest.raises(ValueError, match="no ground truth"):  # training's scorer says so too
        default_reward_fn("minihf/digits", "1,2", None, {})


# ---------------------------------------------------------------------------- plan


def test_plan_checks_out_and_top_before_planning(root, tmp_path):
    base = ["plan", "ppo", "--devices", "2", "--profile", "H100", "--model", f"all={root / 'm'}"]
    for out_path, needle in (("/nonexistent/dir/x.yaml", "/nonexistent/dir does not exist"),
                             ("/proc/x.yaml", "making a file in /proc fails")):
        code, out = run(*base, "--out", out_path)
        refused(code, out, needle)
        assert "| # |" not in out, out  # refused before the search, not after its table
    for top in ("0", "-1"):
        refused(*run(*base, "--top", top), f"--top {top} must be >= 1")
    data = tmp_path / "train.jsonl"
    shutil.copy(root / "data" / "test.jsonl", data)
    before = data.read_text()
    refused(*run(*base, "--out", data), "exists and is not a plan `minihf plan` wrote")
    assert data.read_text() == before
    plan = tmp_path / "plan.yaml"
    # --model with --out: the recipe would train its own models with budgets sized for these
    refused(*run(*base, "--top", "1", "--out", plan), "--out writes a recipe that trains the recipe's models")
    assert not plan.exists()
    paths = [f"actor_rollout_ref.model.path={root / 'm'}", f"critic.model.path={root / 'm'}"]
    for _ in range(2):  # written, then replaced
        code, out = run(*base[:6], *paths, "--top", "1", "--out", plan)
        assert code == 0 and f"wrote {plan}" in out and out.count("| 1 |") == 1 and "| 2 |" not in out, out
    assert plan.read_text().startswith("# written by `minihf plan`") and str(root / "m") in plan.read_text()


# ---------------------------------------------------------------------------- export, make-data


def test_export_and_make_data_name_a_bad_meta_json_or_an_unwritable_target(root, tmp_path):
    from minihf.models import load_hf
    from minihf.utils.checkpoint import save_checkpoint

    ckpt = tmp_path / "global_step_1" / "actor"
    save_checkpoint(ckpt, load_hf(root / "m"), hf_source=root / "m")
    refused(*run("export", ckpt, "/proc/x"), "export target /proc/x cannot be created: making an entry in /proc fails")
    refused(*run("make-data", "digits", "/proc/md"), "/proc/md cannot be created: making an entry in /proc fails")
    refused(*run("make-data", "sort", tmp_path / "md", "--pairs-by", "cost"), "--pairs-by cost ranks preference "
            "pairs: pass --pairs too")  # (it wrote prompts without a word)
    with pytest.warns(UserWarning, match="has no LoRA adapters to merge; it is exported as the plain model"):
        assert run("export", ckpt, tmp_path / "merged", "--merge")[0] == 0
    from minihf.hub.export import model_dir_of  # (eval and generate export with merge: no warning there)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (model_dir_of(ckpt, tmp_path / "scratch") / "config.json").is_file()
    meta = ckpt / "meta.json"
    for text, needle in (("[]\n", "holds a JSON list, not an object"),
                         ('{"head": "lm", "lora": {"rank": 2}}\n', "lacks ['alpha', 'modules'")):
        meta.write_text(text)
        refused(*run("export", tmp_path / "global_step_1", tmp_path / "out"), "meta.json", needle)


def test_torchrun_spellings_are_one_line_and_h_is_help():
    """torchrun's --nproc_per_node=2 came through as an unknown config key, --standalone as a
    recipe name followed by 31 recipe names; -h was 'No such option'."""
    for flag in ("--nproc_per_node=2", "--standalone"):
        code, out = run("train", flag)
        refused(code, out, f"{flag!r} is not an option here: minihf's launch options are --nproc-per-node")
    for args in (("train", "-h"), ("config", "show", "-h"), ("recipe", "new", "-h")):
        code, out = run(*args)
        assert code == 0 and "Usage:" in out, (args, out)
    for kind in ("train", "sft", "rm"):  # the usage line shows the recipe and overrides
        assert f" {kind} [OPTIONS] [RECIPE] [KEY=VALUE]..." in run(kind, "--help")[1]  # (CliRunner: "root")


def test_a_wrong_model_path_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """`minihf train` with a typo'd model.path built the task data and a model, started the
    ranks, then failed (exit 1): now one line, exit 2, and nothing written."""
    monkeypatch.chdir(tmp_path)
    base = ["train", "actor_rollout_ref.model.path=/nonexistent", f"trainer.default_local_dir={tmp_path}/run"]
    refused(*run(*base), "prepare.sft_recipe exports to outputs/sft_sort/hf, but actor_rollout_ref.model.path="
            "'/nonexistent'; make them the same dir", "or set prepare.sft_recipe=null")
    refused(*run(*base, "prepare.sft_recipe=null"), "actor_rollout_ref.model.path='/nonexistent' has no config.json")
    assert list(tmp_path.iterdir()) == []


def test_export_never_replaces_what_it_reads(root, tmp_path):
    """OUT is replaced whole with --overwrite: `export run/global_step_1 run --overwrite`
    deleted the run's every checkpoint (and --merge onto lora.base, every LoRA checkpoint's
    base). Refused before anything is read or written."""
    from minihf.hub.export import check_not_over
    from minihf.models import load_hf
    from minihf.utils.checkpoint import save_checkpoint

    run_dir = tmp_path / "run"
    ckpt = run_dir / "global_step_1" / "actor"
    save_checkpoint(ckpt, load_hf(root / "m"), hf_source=root / "m")
    for out, how in ((run_dir, "holds"), (ckpt, "is"), (ckpt / "hf" / "x", "is inside")):
        refused(*run("export", run_dir / "global_step_1", out, "--overwrite"), f"export target {out} {how} the checkpoint")
    assert (ckpt / "meta.json").is_file()
    with pytest.raises(ValueError, match="holds its LoRA base model"):
        check_not_over(root, [("its LoRA base model", root / "m")])
    check_not_over(tmp_path / "elsewhere", [("the checkpoint", ckpt)])


def test_a_moe_lora_on_experts_and_dense_mlps_exports_merged_only(root, tmp_path):
    """peft maps the leaf names (gate_proj, ...) onto a transformers-5 MoE's experts when it
    loads an adapter dir, and drops the dense MLP layers' adapters (mlp_only_layers): the
    adapter dir loaded 0.14 off the trainer's logits, without a word. Refused; --merge."""
    import json

    ckpt = tmp_path / "global_step_1" / "actor"
    ckpt.mkdir(parents=True)
    modules = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.1.mlp.gate_proj",
               "model.layers.0.self_attn.q_proj"]
    (ckpt / "meta.json").write_text(json.dumps({"head": "lm", "lora": {
        "rank": 4, "alpha": 8, "modules": modules, "target_modules": ["gate_proj", "q_proj"], "base": str(root / "m")}}))
    refused(*run("export", ckpt, tmp_path / "out"), "adapts the experts and the dense MLP layers",
            "model.layers.1.mlp.gate_proj beside model.layers.0.mlp.experts.0.gate_proj", "export it with --merge")


# ---------------------------------------------------------------------------- YAML size


def test_an_oversized_recipe_is_refused_by_its_size_before_parsing(tmp_path):
    recipe = tmp_path / "big"
    recipe.mkdir()  # 10,000 lines, 230 KB: it parsed for seconds (300k lines: over a minute)
    (recipe / "config.yaml").write_text("".join(f"key{i:07d}: 1234567890\n" for i in range(10_000)))
    code, out = run("config", "show", recipe)
    refused(code, out, "is 230,000 bytes, over the 128 KiB minihf reads as YAML")

    from minihf.utils.yaml_load import MAX_BYTES, YAMLInputError, load_yaml, load_yaml_file

    start = time.monotonic()
    with pytest.raises(YAMLInputError, match="over the 128 KiB"):
        load_yaml_file(recipe / "config.yaml", "recipe")
    assert time.monotonic() - start < 0.5, "refused by its size, not after the parse"
    with pytest.raises(YAMLInputError, match="over the 128 KiB"):  # an override value too
        load_yaml("x" * (MAX_BYTES + 1), "value")
    # every shipped recipe is far below the bound
    sizes = [p.stat().st_size for p in (ROOT / "src" / "minihf" / "recipes").glob("*/*.yaml")]
    assert sizes and max(sizes) * 10 < MAX_BYTES
