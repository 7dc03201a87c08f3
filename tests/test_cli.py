"""The ``minihf`` CLI skeleton: --help, --version, doctor (incl. a module that fails to import)."""

import re

import click
import torch
import typer
from typer.testing import CliRunner

from minihf import __version__
from minihf.cli import app
from minihf.cli.doctor import _version_of, report


def test_version_and_help():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"minihf {__version__}"
    res = CliRunner().invoke(app, ["--help"])
    assert res.exit_code == 0
    for command in ("doctor", "init-model", "make-data", "generate", "train", "sft", "export"):
        assert command in res.output, command


def _commands(group, path=()):
    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def test_bracketed_words_survive_help_markup():
    """Help is rich markup, where ``[word]`` is a style tag that vanishes unless escaped
    (``\\[word]``): every bracketed word of a command's or option's help is shown."""
    checked = 0
    for path, cmd in _commands(typer.main.get_command(app)):
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        words = {w for t in texts for w in re.findall(r"\[([^\[\]]+)\]", t)}
        if not words:
            continue
        res = CliRunner().invoke(app, [*path, "--help"])
        assert res.exit_code == 0, res.output
        shown = " ".join(res.output.split())  # rich wraps lines
        for w in words:
            assert f"[{w}]" in shown, (path, w, res.output)
            checked += 1
    assert checked >= 3  # generate's [length] and [max_model_len], convert-gguf's [gguf]


def test_command_summaries_are_one_line():
    """``minihf --help`` lists each command by its help's first paragraph, keeping its line
    breaks: a summary that runs over lines comes out broken mid-sentence."""
    for path, cmd in _commands(typer.main.get_command(app)):
        summary = (cmd.help or "").split("\n\n")[0]
        assert summary and "\n" not in summary, (path, summary)


def test_doctor_names_the_library_of_the_cpu_linears(monkeypatch):
    import minihf.models.linear as linear
    from minihf.cli.doctor import cpu_linears

    monkeypatch.setattr(linear, "use_onednn", lambda: False)
    assert cpu_linears() == "MKL (torch.mm)"
    monkeypatch.setattr(linear, "use_onednn", lambda: True)
    monkeypatch.setattr(linear, "MIN_MACS_PER_THREAD", 1 << 21)
    assert cpu_linears() == "oneDNN from 2M multiply-adds per thread, MKL below"


def test_doctor_reports_this_machine():
    res = CliRunner().invoke(app, ["doctor"])
    assert res.exit_code == 0, res.output
    lines = {line[:26].strip(): line[27:] for line in res.output.splitlines()}  # "key<26 value"
    assert lines["torch"] == torch.__version__
    assert lines["gloo"] == "True"  # every torch build this project supports has gloo
    assert lines["torch threads"] == str(torch.get_num_threads())
    for key in ("cuda available", "nccl", "flash-attn", "transformers", "cpu", "cpu fp32 linears",
                "cpu cores"):
        assert key in lines, key
    assert set(report()) == set(lines)


def test_doctor_checks_the_threads_of_planned_ranks(monkeypatch):
    from minihf.utils import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: threads.Cores(2, "2 in this process's CPU affinity"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    res = CliRunner().invoke(app, ["doctor", "--nproc-per-node", "2"])
    assert res.exit_code == 0, res.output
    lines = {line[:26].strip(): line[27:] for line in res.output.splitlines()}
    assert lines["usable cores"] == "2 (2 in this process's CPU affinity)"
    assert lines["threads per rank (auto)"] == "1 x 2 ranks: fits"
    assert lines["threads per rank (inherit)"] == ("2 x 2 ranks: oversubscribed: 4 threads on 2 cores "
                                                   "(controller.threads=auto, the default, avoids it)")
    res = CliRunner().invoke(app, ["doctor", "--nproc-per-node", "3"])
    assert "1 x 3 ranks: oversubscribed: 3 threads on 2 cores; start at most 2 ranks here" in res.output
    # OMP_NUM_THREADS unset: the ranks get the share minihf's launcher exports, not this
    # process's default (it called 2 ranks x 2 threads oversubscribed)
    monkeypatch.delenv("OMP_NUM_THREADS")
    res = CliRunner().invoke(app, ["doctor", "--nproc-per-node", "2"])
    lines = {line[:26].strip(): line[27:] for line in res.output.splitlines()}
    assert lines["threads per rank (inherit)"] == "1 x 2 ranks: fits", res.output
    res = CliRunner().invoke(app, ["doctor", "--nproc-per-node", "0"])
    assert res.exit_code != 0 and "--nproc-per-node" in res.output


def test_doctor_survives_a_broken_install(tmp_path, monkeypatch):
    (tmp_path / "broken_ext_mod.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _version_of("broken_ext_mod").startswith("installed but fails to import (ImportError")
    assert _version_of("surely_not_a_module_xyz") == "not installed"


def test_train_refuses_bad_recipes_and_keys_with_one_line():
    res = CliRunner().invoke(app, ["train", "grpoo"])
    assert res.exit_code == 2 and "did you mean 'grpo'" in res.output, res.output
    res = CliRunner().invoke(app, ["train", "ppo", "algorithm.adv_estimatr=gae"])
    assert res.exit_code == 2 and "adv_estimator" in res.output, res.output


def test_output_paths_under_a_file_are_one_line(tmp_path):
    """``minihf export CKPT afile/sub`` and ``init-model afile/x`` name the file in the way
    (they failed with a NotADirectoryError traceback)."""
    from typer.testing import CliRunner

    from minihf.cli import app

    (tmp_path / "afile").write_text("x")
    runner = CliRunner()
    res = runner.invoke(app, ["init-model", str(tmp_path / "afile" / "x")])
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "afile is a file, not a directory" in flat, res.output
    assert runner.invoke(app, ["init-model", str(tmp_path / "m")]).exit_code == 0
    ckpt = tmp_path / "ckpt"
    from minihf.models import load_hf
    from minihf.utils.checkpoint import save_checkpoint

    save_checkpoint(ckpt, load_hf(tmp_path / "m"), hf_source=tmp_path / "m")
    res = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "afile" / "sub")])
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "export target" in flat and "afile is a file" in flat, res.output
