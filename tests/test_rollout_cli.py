"""``minihf generate``: text in, text out, on an offline random-init model; greedy output equals
the library's for the same ids."""

import os
import subprocess
import sys

from typer.testing import CliRunner

from minihf.cli import app


def test_generate_command(tmp_path):
    runner = CliRunner()
    model = tmp_path / "m"
    res = runner.invoke(app, ["init-model", str(model), "--size", "tiny", "--task", "arith"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["generate", str(model), "--prompt", "12+3=", "--prompt", "7+8=", "--max-tokens", "6"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("'12+3=' -> ")

    from minihf.data.tokenizer import load_tokenizer
    from minihf.rollout import LLM, SamplingParams
    from minihf.rollout.llm import eos_ids_from_dir

    tok = load_tokenizer(model)
    import json

    eos = set(eos_ids_from_dir(model, json.loads((model / "config.json").read_text()))) | {tok.eos_token_id}
    ids = tok("12+3=", add_special_tokens=True)["input_ids"]
    out = LLM(str(model), eos_token_ids=eos).generate([ids], SamplingParams(temperature=0, max_tokens=6))[0]
    cut = "" if out.outputs[0].finish_reason == "stop" else "  [length]"   # why it did not end at EOS
    assert lines[0] == f"'12+3=' -> {tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)!r}{cut}"

    res = runner.invoke(app, ["generate", str(model), "--prompt", "1+1=", "--top-p", "0"])
    assert res.exit_code != 0 and "top_p" in res.output

    # a training checkpoint (an RL run's global_step_N/actor) generates like its model dir
    from minihf.models import load_hf
    from minihf.utils.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "run" / "global_step_1" / "actor", load_hf(model), hf_source=model)
    argv = ["--prompt", "12+3=", "--prompt", "7+8=", "--max-tokens", "6"]
    from_ckpt = runner.invoke(app, ["generate", str(tmp_path / "run" / "global_step_1"), *argv])
    assert from_ckpt.exit_code == 0 and from_ckpt.output.strip().splitlines() == lines, from_ckpt.output
    res = runner.invoke(app, ["generate", str(tmp_path / "nowhere"), *argv])
    assert res.exit_code != 0 and "neither an HF model dir" in " ".join(res.output.replace("│", "").split())


def test_generate_refuses_unknown_characters_and_says_why_it_stopped(tmp_path):
    runner = CliRunner()
    model = tmp_path / "m"
    assert runner.invoke(app, ["init-model", str(model), "--size", "tiny", "--task", "sort"]).exit_code == 0
    res = runner.invoke(app, ["generate", str(model), "--prompt", "1,2x;"])
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code != 0 and "has characters outside the model's vocabulary: [';', 'x']" in flat
    assert "pass --allow-unk" in flat
    # bytes that are not UTF-8 on the command line (Python passes them as surrogate escapes)
    res = subprocess.run([sys.executable, "-c", "from minihf.cli import app; app()", "generate", str(model),
                          "--prompt", os.fsdecode(b"1,\xff2")], capture_output=True, text=True, timeout=120)
    flat = " ".join(res.stderr.replace("│", " ").split())
    assert res.returncode != 0 and "prompt 1 is not UTF-8 text (byte 0xff at character 2); pass UTF-8" in flat, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) < 10, res.stderr
    res = runner.invoke(app, ["generate", str(model), "--prompt", "1,2x", "--allow-unk", "--max-tokens", "2"])
    assert res.exit_code == 0 and res.output.startswith("'1,2x' -> ")
    # greedy on a random model rarely stops: 40 tokens do not fit a context of 10
    res = runner.invoke(app, ["generate", str(model), "--prompt", "1,2,3,4", "--max-tokens", "40",
                              "--max-model-len", "10"])
    assert res.exit_code == 0 and res.output.strip().endswith("[max_model_len]"), res.output
