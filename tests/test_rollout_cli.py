"""``minihf generate``: text in, text out, on an offline random-init model; greedy output equals
the library's for the same ids."""

from typer.testing import CliRunner

from minihf.cli import app


def test_generate_command(tmp_path):
    runner = CliRunner()
    model = tmp_path / "m"
    res = runner.invoke(app, ["init-model", str(model), "--size", "tiny", "--task", "arith"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["generate", str(model), "--prompt", "12+3=", "--prompt", "7*8=", "--max-tokens", "6"])
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
    assert lines[0] == f"'12+3=' -> {tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)!r}"

    res = runner.invoke(app, ["generate", str(model), "--prompt", "1+1=", "--top-p", "0"])
    assert res.exit_code != 0 and "top_p" in res.output
