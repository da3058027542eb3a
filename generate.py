"""Generate text from a tpframe checkpoint, tensor-parallel.

    python -m tpframe.launch --nproc-per-node N generate.py --checkpoint DIR [--tp N] --prompt "..." [--prompt ...] \\
        [--prompts FILE] [--max-new-tokens 64] [--greedy | --temperature T --top-k K --top-p P] [--seed S] [--json]
    torchrun --standalone --nproc-per-node N generate.py ...    # works too
    python generate.py --checkpoint DIR --prompt "..."          # one process, no launcher needed

DIR is a checkpoint step directory, a checkpoints root with `latest`, a .safetensors export
(tools/checkpoint.py export), or a Hugging Face model directory (GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral,
Qwen3-MoE, Phi-3 in safetensors, with its tokenizer.json). The checkpoint may have been saved at any TP/PP/DP layout;
its weights are resharded to this run's TP size (the number of processes). Prints one generated text per prompt, or
with --json one JSON object per line: prompt, text, token_ids (the generated ids) and tokens_per_s.

The path of a prompt: text.py (tokenizer, prompts) -> loading.py (weights, this rank's shards) ->
Generator (tpframe/inference/generate.py: prefill, then CUDA-graphed decode steps with the KV cache and
the vocab-parallel sampler) -> text. Mistakes in the arguments, the checkpoint, the tokenizer or the
prompts stop here with one line and exit code 2, before any process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import torch

from tpframe.errors import ArgumentParser, ConfigError
from tpframe.launch import launch_env, single_process_env

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="step directory, checkpoints root (with `latest`), .safetensors export or HF model directory",
    )
    p.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (default and only choice: the world size)"
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="a file of prompts: one per line, or .jsonl ('prompt' or 'text' key, or strings); '-' reads standard "
        "input, plain text, one prompt per line (one process, no launcher)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt at most (default 64)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature, top-k, top-p)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample among the most likely tokens of total probability p (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0; the same tokens at any TP size)")
    p.add_argument(
        "--tokenizer", help="a Hugging Face tokenizer.json (default: the one the checkpoint's data was made with)"
    )
    p.add_argument("--eot-token", help="the end-of-text token of --tokenizer (default: detected)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    p.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture the decode step in a CUDA graph (GPU only; default on)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=("default", "max-autotune-no-cudagraphs"),
        help="torch.compile each block first (costs compile time up front, more for larger models): fewer, "
        "fused kernels per token; max-autotune-no-cudagraphs also tunes the small-batch matmuls",
    )
    p.add_argument("--comm", choices=("auto", "nccl", "symm"), default="auto", help="TP communication backend")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    return p.parse_args(argv)


@dataclass
class Plan:
    """Everything checked before any process group: what to load, how to tokenize, what to generate."""

    args: argparse.Namespace
    source: object  # tpframe.inference.loading.ModelSource
    tokenizer: object
    prompts: list[str]
    prompt_ids: list[list[int]]
    tp: int
    model: object  # the ModelConfig to build (generation_model)
    stop_ids: list[int]  # the end-of-text id(s) generation stops at (text.stop_ids)


def check_tp(cfg, tp: int) -> None:
    from tpframe.models.config import ffn_hidden_size, moe_ffn_hidden_size

    kv = cfg.kv_heads or cfg.heads
    ffn = (
        ("each expert's FFN size", moe_ffn_hidden_size(cfg))
        if cfg.moe_experts
        else ("the FFN size", ffn_hidden_size(cfg))
    )
    for key, value in (("model.heads", cfg.heads), ("model.kv_heads", kv), ffn):
        if value % tp:
            raise ConfigError(f"tensor-parallel size {tp} does not divide {key} = {value}; run with fewer processes")


def prepare(argv: list[str] | None, *, world_size: int | None = None) -> Plan:
    """Check everything before any process group; `world_size` defaults to the launcher's env (WORLD_SIZE)."""
    from tpframe.inference.loading import open_source
    from tpframe.inference.text import encode_prompts, read_prompts, resolve_tokenizer, stop_ids

    args = parse_args(argv)
    world = world_size or launch_env().world_size
    tp = args.tp if args.tp is not None else world
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1 (the tensor-parallel size: one process per rank), got {tp}")
    if tp != world:
        raise ConfigError(
            f"--tp {tp} but {world} process(es): generate.py runs one tensor-parallel group; "
            f"launch with python -m tpframe.launch --nproc-per-node {tp}"
        )
    if args.prompts == "-" and (world > 1 or world_size is not None):  # world_size: tpframe.launch's pre-flight
        raise ConfigError(
            "--prompts - reads standard input, which only one process run directly (python generate.py ...) can "
            f"read, not {world} process(es) of a launcher; write the prompts to a file and pass --prompts FILE"
        )
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not -(2**63) <= args.seed < 2**64:
        raise ConfigError(f"--seed {args.seed} does not fit torch's 64-bit generator seed; use 0 to 2**64-1")
    try:
        sampling(args).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    source = open_source(args.checkpoint)
    check_tp(source.model, tp)
    if args.eot_token is not None and args.tokenizer is None:
        raise ConfigError("--eot-token names the end-of-text token of --tokenizer FILE; pass both, or neither")
    tok = resolve_tokenizer(source, args.tokenizer, args.eot_token)
    prompts = read_prompts(args.prompt, args.prompts)
    ids = encode_prompts(tok, prompts, context=source.model.max_seq_len, max_new_tokens=args.max_new_tokens)
    return Plan(
        args,
        source,
        tok,
        prompts,
        ids,
        tp,
        generation_model(source.model, ids, args.max_new_tokens),
        stop_ids(source, tok, own_tokenizer=args.tokenizer is None),
    )


def generation_model(cfg, prompt_ids: list[list[int]], max_new_tokens: int):
    """The model to build: with rotary positions, whose table sizes no weight, one of just the context this generation
    uses (an HF Llama may allow a context far longer than memory holds: max_position_embeddings)."""
    from tpframe.inference.generate import cache_slots

    if cfg.position != "rotary":
        return cfg
    return dataclasses.replace(
        cfg, max_seq_len=min(cfg.max_seq_len, cache_slots(max(map(len, prompt_ids)), max_new_tokens))
    )


def sampling(args):
    from tpframe.inference.sampling import SamplingConfig

    return SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def run(plan: Plan) -> list[dict]:
    """Build the TP group and the model, load this rank's shards, generate; returns one record per prompt."""
    from tpframe.checkpoint.export import copy_logical_tensors
    from tpframe.inference import Generator
    from tpframe.inference.loading import read_weights
    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.parallel import destroy_parallel, initialize_parallel

    args, cfg = plan.args, plan.model
    tensors = read_weights(plan.source)  # every rank reads the full tensors (CPU), no process group needed
    state = initialize_parallel(tp=plan.tp, comm_backend=args.comm)
    try:
        cuda = state.device.type == "cuda"
        dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if cuda else torch.float32)
        model = build_model(cfg, BuildContext(state.tp_comm, dtype=dtype, device=state.device)).eval()
        if not callable(getattr(model, "kv_cache_spec", None)):
            raise ConfigError(
                f"model.name={cfg.name!r} built a {type(model).__name__} without kv_cache_spec(), which generation "
                "needs (tpframe/models/protocol.py)"
            )
        copy_logical_tensors(model, tensors, state.tp_rank, state.tp, source=f"--checkpoint {args.checkpoint!r}")
        del tensors
        if args.compile:
            compile_model(model, mode=args.compile)
        gen = Generator(
            model,
            state.tp_comm,
            sampling=sampling(args),
            vocab_size=min(cfg.vocab_size, plan.tokenizer.vocab_size),
            eos_id=None if args.ignore_eos else plan.stop_ids,
            seed=args.seed,
            cuda_graph=args.cuda_graph,
        )
        out = gen.generate(plan.prompt_ids, args.max_new_tokens)
        seconds = out.prefill_s + out.decode_s
        return [
            {
                "prompt": prompt,
                "text": plan.tokenizer.decode(ids),
                "token_ids": ids,
                "tokens_per_s": round(len(ids) / seconds, 2) if seconds > 0 else None,
            }
            for prompt, ids in zip(plan.prompts, out.tokens)
        ]
    finally:
        destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    try:
        rank0 = launch_env().rank == 0
    except ConfigError:  # prepare says what is wrong with it, as rank 0
        rank0 = True
    try:
        plan = prepare(argv)
        single_process_env()
        records = run(plan)
    except ConfigError as e:
        if rank0:
            print(f"tpframe: error: {e}", file=sys.stderr)
        return 2
    if rank0:
        for i, r in enumerate(records):
            if plan.args.json:
                print(json.dumps(r, ensure_ascii=False), flush=True)
                continue
            if len(records) > 1:  # a completion may hold newlines: each one under a line naming its prompt
                print(f"=== prompt {i + 1}/{len(records)}: {r['prompt']!r}", flush=True)
            print(r["text"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
