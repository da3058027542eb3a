"""Packed documents (model.attention_mask=document) on one GPU: the attention, and the whole model's step.

    python benchmarks/documents.py [--doc-lens 256,1024] [--model] [--results benchmarks/RESULTS.md] [--no-append]

Attention alone, forward + backward, random bf16 q, k, v and upstream gradient, rows packed with documents of
1..2m-1 tokens (mean m), side by side in one process:
  - causal, whole rows: SDPA's causal Flash attention over each row, no document mask (what the mask costs against);
  - tpframe: tpframe.layers.documents.document_attention (variable-length Flash attention, one sequence per
    document of the flattened batch), and the `Documents` it needs built from the token ids (timed apart); given
    q, k, v in token-major memory ([b, s, n, d], as the attention layer writes them for documents) and, for
    comparison, head-major ([b, n, s, d], which it must copy to [b*s, n, d] and back);
  - dense mask: SDPA with the [b, 1, s, s] boolean mask (tpframe's fallback off CUDA or with attention dropout);
  - flex + compile: torch's flex_attention compiled, with a block-causal BlockMask (torchtitan's document masking),
    and building that BlockMask per batch (timed apart).
Median of 10 calls after 3 warm-up calls (CUDA events). Useful FLOPs (causal inside each document, forward +
backward as benchmarks/cp_attention.py counts them): 7*nq*d*sum(L_i^2) over the documents' lengths L_i.
--model also runs benchmarks/gpt.py (GPT-1.3B, TP=1, bf16, forward + backward) as one-process subprocesses, causal
and with DOC_LEN, eager and compiled, and prints their steps side by side.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from comm import report  # noqa: E402
from cp_attention import timed  # noqa: E402
from gpt import document_ends  # noqa: E402
from train_runs import run_job  # noqa: E402

from tpframe.layers.documents import Documents, document_attention, uses_varlen  # noqa: E402

SHAPES = {  # name: (batch, seq, query heads, kv heads, head dim)
    "GPT-1.3B (b=8 S=2048, 16 heads, d=128)": (8, 2048, 16, 16, 128),
    "Llama-8B-style (b=1 S=8192, 32 heads, GQA 8, d=128)": (1, 8192, 32, 8, 128),
}


def attention_rows(doc_lens: list[int], dev: torch.device) -> list[str]:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    rows = []
    for name, shape in SHAPES.items():
        for mean in doc_lens:
            rows += attention_case(name, shape, mean, dev, flex)
            torch.cuda.empty_cache()
    return rows


def attention_case(name: str, shape: tuple, mean: int, dev: torch.device, flex) -> list[str]:
    """Every attention of the table on one shape, documents of mean length `mean`: its rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s, nq, nkv, d = shape
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(b, n, s, d, generator=g, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for n in (nq, nkv, nkv)
    )
    dout = torch.randn(b, nq, s, d, generator=g, device=dev, dtype=torch.bfloat16)
    ids = torch.ones(b, s, dtype=torch.long)
    ids.view(-1)[document_ends(b * s, mean)] = 0
    ids = ids.to(dev)
    docs = Documents.from_tokens(ids, 0)
    assert uses_varlen(q, docs), "the variable-length Flash path is not available on this torch"
    lengths = (docs.cu_seqlens[1:] - docs.cu_seqlens[:-1]).double()
    useful = 7 * nq * d * float(lengths.square().sum())
    gqa = nq != nkv
    doc_ids = docs.ids

    def block_causal(b_, h_, qi, ki):
        return (qi >= ki) & (doc_ids[b_, qi] == doc_ids[b_, ki])

    def block_mask():
        return create_block_mask(block_causal, b, None, s, s, device=dev)

    bm = block_mask()
    # the same values in token-major memory ([b, s, n, d]), as tpframe's attention layer hands them over for
    # documents: varlen reads them as [b*s, n, d] with no copy, and its gradients go back as they come
    leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    varlen_tm = "tpframe document_attention (varlen Flash), token-major inputs (the model's)"
    dense = "dense mask SDPA (tpframe's fallback)"
    flex_label = "flex_attention + compile, block-causal (torchtitan's way)"
    runs = {
        "causal, whole rows (no document mask)": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=gqa
        ),
        "tpframe document_attention (varlen Flash), head-major inputs (copied)": lambda: document_attention(
            q, k, v, docs, enable_gqa=gqa
        ),
        varlen_tm: lambda: document_attention(qt, kt, vt, docs, enable_gqa=gqa),
        dense: lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(), enable_gqa=gqa),
        flex_label: lambda: flex(q, k, v, block_mask=bm, enable_gqa=gqa),
    }
    want = runs[dense]().float()
    setup = {varlen_tm: timed(lambda: Documents.from_tokens(ids, 0)), flex_label: timed(block_mask)}
    rows = []
    for label, fn in runs.items():

        def fwd_bwd(fn=fn, inputs=leaves if "token-major" in label else (q, k, v)):
            torch.autograd.grad(fn(), inputs, dout)

        ms = timed(fwd_bwd)
        with torch.no_grad():
            err = float((fn().float() - want).abs().max()) if "whole rows" not in label else float("nan")
        per_batch = setup.get(label)
        rows.append(
            f"| {name} | {mean} | {len(lengths)} | {label} | {ms:.2f} | "
            + (f"{per_batch:.2f}" if per_batch is not None else "-")
            + f" | {useful / ms / 1e9:.0f} | "
            + ("-" if err != err else f"{err:.1e}")
            + " |"
        )
        print(rows[-1], flush=True)
    return rows


def model_rows(doc_len: int) -> list[str]:
    """benchmarks/gpt.py at GPT-1.3B TP=1, causal and packed, eager and compiled: its RESULT lines."""
    rows = []
    for compile_ in ("0", "1"):
        for docs in ("0", str(doc_len)):
            env = dict(os.environ, NO_APPEND="1", COMPILE=compile_, DOC_LEN=docs, STEPS="10", PYTHONUNBUFFERED="1")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "1",
                str(ROOT / "benchmarks" / "gpt.py"),
            ]
            code, output = run_job(cmd, env=env, timeout=400)
            line = next((ln for ln in output.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                what = "no result within 400 s" if code is None else f"exit {code}"
                raise SystemExit(
                    f"benchmarks/gpt.py failed (COMPILE={compile_} DOC_LEN={docs}, {what}):\n{output[-2000:]}"
                )
            step = float(re.search(r"step ([\d.]+) ms", line).group(1))
            tok = float(re.search(r"([\d.]+) tok/s", line).group(1))
            mem = float(re.search(r"mem ([\d.]+) GiB", line).group(1))
            what = f"document, mean length {doc_len}" if docs != "0" else "causal (whole rows)"
            rows.append(
                f"| {'compiled blocks' if compile_ == '1' else 'eager'} | {what} | {step:.1f} | {tok:,.0f} | "
                f"{mem:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def cp_rows(doc_len: int, dev: torch.device) -> list[str]:
    """One CP rank's share of packed-document attention (rank 0's two query chunks over the gathered keys of a
    Llama-8B-style row of S = 32768 tokens, 32 heads, GQA 8, d=128): the dense [b, 1, 2c, S] mask (tpframe's path
    before, and off CUDA) against the variable-length sequences of `Documents.for_cp_rank`, at cp = 2, 4, 8. The
    all-gather is the same for both and not timed."""
    rows = []
    for cp in (2, 4, 8):
        rows += cp_case(cp, doc_len, dev)
        torch.cuda.empty_cache()
    return rows


def cp_case(cp: int, doc_len: int, dev: torch.device) -> list[str]:
    from tpframe.layers import documents
    from tpframe.layers.context import local_positions, shard_sequence

    b, s, nq, nkv, d = 1, 32768, 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.ones(b, s, dtype=torch.long)
    ids.view(-1)[document_ends(b * s, doc_len)] = 0
    ids = ids.to(dev)
    docs = documents.Documents.for_cp_rank(ids, 0, rank=0, size=cp)
    q = shard_sequence(
        torch.randn(b, nq, s, d, generator=g, device=dev, dtype=torch.bfloat16), dim=2, rank=0, size=cp
    ).requires_grad_()
    kv = torch.randn(2, b, nkv, s, d, generator=g, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    local = local_positions(s // cp, rank=0, size=cp, device=dev)
    k_lens = [(c.cu_k[1:] - c.cu_k[:-1]).double() for c in docs.chunks]
    q_lens = [(c.cu_q[1:] - c.cu_q[:-1]).double() for c in docs.chunks]
    # useful FLOPs: each query attends its document's earlier keys: 2 GEMMs fwd, 5 bwd, mean keys (lk - lq/2)
    useful = sum(float((ql * (lk - ql / 2)).sum()) for ql, lk in zip(q_lens, k_lens, strict=True)) * 7 * 2 * nq * d

    def dense():
        mask = (docs.ids[:, local, None] == docs.ids[:, None, :]) & (local[:, None] >= torch.arange(s, device=dev))
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask[:, None], enable_gqa=True)

    def varlen():
        return documents._varlen_chunks(q, kv, docs.chunks, True)

    want = dense().float()
    build = timed(lambda: documents.Documents.for_cp_rank(ids, 0, rank=0, size=cp))
    rows = []
    for label, fn in (("dense mask SDPA (before)", dense), ("varlen Flash, per chunk", varlen)):
        ms = timed(lambda fn=fn: torch.autograd.grad(fn(), (q, kv), dout))
        with torch.no_grad():
            err = float((fn().float() - want).abs().max())
        rows.append(
            f"| {cp} | {s // cp} | {doc_len} | {label} | {ms:.2f} | "
            + (f"{build:.2f}" if "varlen" in label else "-")
            + f" | {useful / ms / 1e9:.0f} | {err:.1e} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc-lens", default="256,1024")
    p.add_argument("--model", action="store_true", help="also GPT-1.3B's whole step through benchmarks/gpt.py")
    p.add_argument("--model-doc-len", type=int, default=512)
    p.add_argument("--cp", action="store_true", help="also one CP rank's share at S=32768 (dense mask vs varlen)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/documents.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = [
        "| shape | mean doc length | documents | attention | fwd+bwd ms | build per batch ms | useful TFLOP/s "
        "| max abs diff vs dense mask (fwd) |",
        "|---|---|---|---|---|---|---|---|",
        *attention_rows([int(x) for x in args.doc_lens.split(",")], dev),
    ]
    model = []
    if args.model:
        model = [
            "",
            "Whole model: `benchmarks/gpt.py` (GPT-1.3B L=24 H=2048 16 heads S=2048 MB=8, rotary, bf16, TP=1, "
            "forward + backward, 3 warm-up then 10 timed steps), one subprocess per row:",
            "",
            "| blocks | attention | step ms | tokens/s | peak GiB |",
            "|---|---|---|---|---|",
            *model_rows(args.model_doc_len),
        ]
    if args.cp:
        model += [
            "",
            "One CP rank's share (rank 0) of a Llama-8B-style row, S=32768, 32 heads, GQA 8, d=128, documents "
            f"of mean length {args.model_doc_len}, bf16, forward + backward (the all-gather not timed; 'build' is "
            "Documents.for_cp_rank, once per micro-batch):",
            "",
            "| cp | local tokens | mean doc length | attention | fwd+bwd ms | build ms | useful TFLOP/s | "
            "max abs diff vs dense (fwd) |",
            "|---|---|---|---|---|---|---|---|",
            *cp_rows(args.model_doc_len, dev),
        ]
    device = torch.cuda.get_device_name(dev)
    cmd = (
        "python benchmarks/documents.py"
        + (f" --doc-lens {args.doc_lens}" if args.doc_lens != "256,1024" else "")
        + (" --model" if args.model else "")
        + (" --cp" if args.cp else "")
    )
    text = "\n".join(
        [
            f"## Packed documents (model.attention_mask=document): 1x {device}, {datetime.date.today()}",
            "",
            f"Command: `{cmd}`. torch {torch.__version__}, bf16, forward + backward, median of 10 calls after 3 "
            "warm-up calls (CUDA events), random data; documents of 1..2m-1 tokens (mean m) packed into each row. "
            "Useful FLOPs = 7*nq*d*sum(L_i^2) (causal inside each document); the whole-row causal row does more work "
            "than that (its TFLOP/s counts the same useful FLOPs). 'build per batch': Documents.from_tokens (one host "
            "read-back of the boundaries) or flex's create_block_mask, once per micro-batch, not per layer.",
            "",
            *rows,
            *model,
            "",
        ]
    )
    report(text, args.results, append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
