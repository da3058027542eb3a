"""Context parallelism (tpframe/layers/context.py) against one process holding the whole sequence: the
attention rows (fp64, to rounding), the GPT's per-token losses and gradients (fp32), train.py's losses,
gradient norms and weights over 10 steps at CP 2 and 4 composed with TP+SP, DP (ddp, zero1, fsdp), PP and
recompute, and checkpoints that move between CP layouts."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import assert_layouts_follow, train_in_process
from tpframe.layers.context import CP_COMM_MODES


def test_each_rank_holds_two_chunks_at_their_global_positions():
    from tpframe.layers.context import local_positions, shard_sequence

    seq = torch.arange(16).view(1, 16)
    for cp in (1, 2, 4):
        held = []
        for r in range(cp):
            mine = shard_sequence(seq, dim=1, rank=r, size=cp)[0]
            assert torch.equal(mine, local_positions(16 // cp, rank=r, size=cp)), (cp, r)
            held += mine.tolist()
        assert sorted(held) == list(range(16))
    assert shard_sequence(seq, dim=1, rank=1, size=2)[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_sequence(seq, dim=1, rank=0, size=4)[0].tolist() == [0, 1, 14, 15]
    with pytest.raises(ValueError, match="into 2\\*cp = 4 equal chunks"):
        shard_sequence(torch.arange(6).view(1, 6), dim=1, rank=0, size=2)


def _attention(nq: int, nkv: int):
    import torch.distributed as dist
    import torch.nn.functional as F

    from tpframe.comm import Communicator
    from tpframe.layers.context import context_parallel_attention, shard_sequence
    from tpframe.layers.ulysses import ulysses_attention

    cp, r = dist.get_world_size(), dist.get_rank()
    comm = Communicator(dist.group.WORLD, backend="nccl", device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 8 * cp, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nkv, nkv))
    w = torch.randn(b, nq, s, d, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nq != nkv)
    (ref * w).sum().backward()
    mine = lambda t: shard_sequence(t.detach(), dim=2, rank=r, size=cp)  # noqa: E731
    whole = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])  # noqa: E731, E501
    errors = {}
    for mode, attention in (
        ("all_gather", lambda q, k, v: context_parallel_attention(q, k, v, comm, enable_gqa=nq != nkv)),
        ("all_to_all", lambda q, k, v: ulysses_attention(q, k, v, comm, whole)),
    ):
        ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
        out = attention(ql, kl, vl)
        (out * mine(w)).sum().backward()
        errors[mode] = [(out - mine(ref)).abs().max().item()]
        errors[mode] += [(mine_.grad - mine(t.grad)).abs().max().item() for mine_, t in ((ql, q), (kl, k), (vl, v))]
    comm.close()
    return errors


@pytest.mark.parametrize("cp,nq,nkv", [(2, 4, 2), (4, 4, 1), (4, 8, 2)])
def test_attention_of_each_rank_equals_its_rows_of_whole_sequence_attention(cp, nq, nkv):
    """Output and the gradients of q, k and v (the keys' reduce-scattered back to their owners), GQA and MQA, for
    both cp_comm modes; all_to_all with kv heads cp does not divide (4 and 8 query heads over 1 and 2 kv heads at
    cp=4: each kv head repeated, its gradient summed back)."""
    for rank_errors in run_distributed(_attention, cp, nq, nkv, timeout=120):
        for mode, errors in rank_errors.items():
            assert max(errors) < 1e-6, (mode, errors)  # the CPU kernel keeps its log-sum-exp in fp32


def _started_collectives():
    import torch.distributed as dist

    from tpframe.comm import Communicator

    comm, r = Communicator(dist.group.WORLD, backend="nccl", device=torch.device("cpu")), dist.get_rank()
    x = torch.arange(6.0).view(2, 3) + 10 * r
    gathered, wait = comm.start("all_gather", x)
    wait()
    same = gathered.equal(comm.all_gather(x))
    summed, wait = comm.start("reduce_scatter", torch.arange(4.0 * comm.size).view(2 * comm.size, 2) * (r + 1))
    wait()
    try:
        comm.start("reduce_scatter", torch.zeros(3, 2))
        refused = None
    except ValueError as e:
        refused = str(e)
    comm.close()
    return same, summed.tolist(), refused


def test_started_collectives_equal_the_blocking_ones():
    """Communicator.start (what the CP blocks overlap with attention): the all-gather as the blocking one, the
    reduce-scatter summed over ranks in this rank's slice, a split the ranks cannot share refused by name."""
    for r, (same, summed, refused) in enumerate(run_distributed(_started_collectives, 2, timeout=60)):
        assert same
        assert summed == [[(4 * r + i) * 3.0, (4 * r + i + 1) * 3.0] for i in (0, 2)]  # rows 2r, 2r+1, times 1+2
        assert refused is not None and "divisible by the group size 2" in refused


def _model(archs: list[dict], tp: int):
    import torch.distributed as dist

    from tests.reference import gather_full_tensors
    from tpframe.layers.context import shard_sequence
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import destroy_parallel, initialize_parallel

    def run(cfg, state, ctx, ids, labels):
        """Per-token losses of this rank's tokens and the whole model's gradients of the sequence's mean loss."""
        model = build_model(cfg, ctx)
        mine = lambda t: shard_sequence(t, dim=1, rank=state.cp_rank, size=state.cp)  # noqa: E731
        loss = model(mine(ids), mine(labels))
        loss.mean().backward()
        for p in model.parameters():  # each CP rank's gradient is of its own tokens' mean; SP: partial over TP
            if state.cp > 1:
                dist.all_reduce(p.grad, group=state.cp_group)
                p.grad /= state.cp
            if p.sequence_parallel and state.tp > 1:
                dist.all_reduce(p.grad, group=state.tp_group)
        return loss, gather_full_tensors(model, state.tp_comm, source="grad")

    cp = dist.get_world_size() // tp
    cases = [(ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_seq_len=64, **arch)) for arch in archs]
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in cases:
        ids, labels = (torch.randint(1, 64, (2, 32), generator=g) for _ in range(2))
        ids[0, [5, 13, 20]] = ids[1, [9, 24]] = 0  # the documents' ends (model.eod_id=0 where it is set)
        batches.append((ids, labels))
    state = initialize_parallel(tp=1)  # the reference: the whole sequence on each process alone
    refs = [run(cfg, state, BuildContext(state.tp_comm, seed=3), *batch) for cfg, batch in zip(cases, batches)]
    destroy_parallel()
    state = initialize_parallel(tp=tp, cp=cp)
    out = []
    for arch, cfg, batch, (ref_loss, ref_grads) in zip(archs, cases, batches, refs):
        for mode in ("all_gather", "all_to_all"):
            ctx = BuildContext(
                state.tp_comm,
                sequence_parallel=tp > 1,
                seed=3,
                cp_comm=state.cp_comm,
                mode=LayerMode(cp_comm=mode),
            )
            loss, grads = run(cfg, state, ctx, *batch)
            loss_error = (loss - shard_sequence(ref_loss, dim=1, rank=state.cp_rank, size=cp)).abs().max().item()
            # the gradients within 1e-5 of each tensor's largest, and 1e-8 absolute: the key bias's is zero in exact
            # arithmetic, rounding noise in both runs
            grad_error = max(((grads[n] - g).abs().max() / (g.abs().max() + 1e-3)).item() for n, g in ref_grads.items())
            out.append((arch, mode, loss_error, grad_error))
    return out


ARCHS = [
    dict(position="rotary", kv_heads=2, norm="rmsnorm", activation="swiglu", bias=False),
    dict(position="learned"),
    dict(position="rotary", kv_heads=2, attention_mask="document", eod_id=0, sliding_window=6, bias=False),
]


@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 1), (2, 2)])
def test_gpt_per_token_losses_and_gradients_equal_the_whole_sequence(cp, tp):
    """Both cp_comm modes at CP 2 and 4 and CP=2 x TP=2 + SP: rotary with GQA, learned positions, and packed
    documents under a sliding window (all_to_all repeats the kv heads that cp=4, or TP=2 x CP=2, does not divide);
    the model places each rank's tokens at their global positions."""
    for rank_results in run_distributed(_model, cp * tp, ARCHS, tp, timeout=120):
        for arch, mode, loss_error, grad_error in rank_results:
            assert loss_error < 1e-5 and grad_error < 1e-5, (arch, mode, loss_error, grad_error)


# -- train.py: 10 steps on 4 processes -----------------------------------------------------------------

# name: overrides. The reference is DP=4 (one process's computation: DP is tested equal to it). Every layout
# takes 8 sequences per micro-step (micro-batch x DP), so evaluation sees the same held-out samples. No biases:
# the key bias has a zero gradient in exact arithmetic, so AdamW turns its rounding noise into updates.
ONE_REPLICA = "train.micro_batch_size=8"
A2A = "parallel.cp_comm=all_to_all"
TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "cp=4": ["parallel.cp=4", ONE_REPLICA],
    "cp=4 all_to_all": ["parallel.cp=4", A2A, ONE_REPLICA],
    "cp=2 x tp=2 + SP": ["parallel.cp=2", *TP_SP, ONE_REPLICA],
    "cp=2 x tp=2 + SP all_to_all": ["parallel.cp=2", *TP_SP, A2A, ONE_REPLICA],
    "cp=2 x dp=2 zero1": ["parallel.cp=2", "parallel.dp_strategy=zero1"],
    "cp=2 x dp=2 fsdp": ["parallel.cp=2", "parallel.dp_strategy=fsdp"],
    "cp=2 x pp=2 1f1b all_to_all": ["parallel.cp=2", "parallel.pp=2", A2A, ONE_REPLICA],
    "cp=2 x dp=2 selective": ["parallel.cp=2", "parallel.activation_checkpointing=selective"],
}
COMMON = [
    "parallel.tp=1",
    "model.position=rotary",
    "model.kv_heads=2",
    "model.bias=false",
    "train.global_batch_size=16",
    "train.eval_interval=5",
    "train.eval_steps=2",
]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


# the default suite's layouts (both cp_comm modes, with TP + SP) and the resumes between them; the slow tier: the rest
CORE = ("cp=4", "cp=4 all_to_all", "cp=2 x tp=2 + SP", "cp=2 x tp=2 + SP all_to_all")


def _train_layouts(tmp: str, names: tuple[str, ...], resume: bool):
    out = {}
    ref = train_in_process([*COMMON, "train.micro_batch_size=2", f"train.run_dir={tmp}/ref"], keep_trainer=True)
    out["ref"] = (ref.history, _weights(ref))
    for name in names:
        extra = LAYOUTS[name]
        trainer = train_in_process(
            [*COMMON, *extra, f"train.run_dir={tmp}/{name}", "checkpoint.interval=5"], keep_trainer=True
        )
        plain = not any(k in " ".join(extra) for k in ("tp=2", "pp=2", "fsdp"))  # whole, plain parameters here
        out[name] = (trainer.history, _weights(trainer) if plain else None)
    # step-5 checkpoints resume on other layouts and in the other cp_comm mode: CP=2 x TP=2's at CP=1 (DP=4) and at
    # CP=4; CP=4's at CP=2 x TP=2, all_gather <-> all_to_all
    for name, saved, extra in (
        ()
        if not resume
        else (
            ("resumed at dp=4", "cp=2 x tp=2 + SP", ["train.micro_batch_size=2"]),
            ("resumed at cp=4", "cp=2 x tp=2 + SP", LAYOUTS["cp=4"]),
            ("resumed at cp=2 x tp=2 all_to_all", "cp=4", LAYOUTS["cp=2 x tp=2 + SP all_to_all"]),
            ("resumed at cp=2 x tp=2", "cp=4 all_to_all", LAYOUTS["cp=2 x tp=2 + SP"]),
        )
    ):
        load = f"checkpoint.load={tmp}/{saved}/checkpoints/step_00000005"
        out[name] = (train_in_process([*COMMON, *extra, load, f"train.run_dir={tmp}/{name}"]), None)
    return out


# Step 5's gradient norm in this setup moves by 4e-5 to 7e-5 with the micro-batch size or TP alone (no CP,
# measured): a rounding-sensitive step. Every other step's norm is within 2e-6, every loss within 1e-6.
TOL_GRAD_NORM = 2e-4


def test_train_py_context_parallel_layouts_equal_one_process_and_resume_across_cp(tmp_path):
    """Losses, eval losses and gradient norms of 10 steps in both cp_comm modes with TP+SP equal one process's;
    resumed runs equal its steps 6-10, so the weights, the optimizer and the data position all came back."""
    _assert_layouts(tmp_path, CORE, resume=True)


@pytest.mark.slow
def test_train_py_context_parallel_with_dp_strategies_pp_and_recompute_equals_one_process(tmp_path):
    """The same with zero1, fsdp, PP=2 (all_to_all) and selective recompute."""
    _assert_layouts(tmp_path, tuple(n for n in LAYOUTS if n not in CORE), resume=False)


def _assert_layouts(tmp_path, names: tuple[str, ...], *, resume: bool) -> None:
    results = run_distributed(_train_layouts, 4, str(tmp_path), names, resume, timeout=600)[-1]  # rank 3: last stage
    ref_history, ref_weights = results.pop("ref")
    ref = {r["step"]: r for r in ref_history}
    assert len(ref) == 10
    assert_layouts_follow(ref_history, results, grad_norm_rel=TOL_GRAD_NORM)
    for name, (_history, weights) in results.items():
        if weights is not None:
            for n, value in ref_weights.items():
                error = ((weights[n] - value).norm() / value.norm()).item()
                assert error < 1e-5, (name, n, error)


# -- memory ------------------------------------------------------------------------------------------------

MEMORY_LAYOUTS = [[]] + [[f"parallel.cp={cp}", f"parallel.cp_comm={mode}"] for cp in (2, 4) for mode in CP_COMM_MODES]


def _kept_and_estimated(common: list[str]):
    """(layout, bytes autograd saved in one forward, the pre-flight's activation estimate) on rank 0."""
    import torch.distributed as dist

    from tests.reference import kept_for_backward
    from tests.training_utils import REPO
    from tpframe.layers.context import shard_sequence
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import destroy_parallel, initialize_parallel
    from tpframe.run.memory import activation_bytes
    from tpframe.training.config import load_config

    out = []
    for layout in MEMORY_LAYOUTS:
        cfg = load_config(f"{REPO}/configs/tiny_cpu.yaml", [*common, *layout])
        state = initialize_parallel(tp=1, cp=cfg.parallel.cp)
        ctx = BuildContext(state.tp_comm, seed=3, cp_comm=state.cp_comm, mode=LayerMode(cp_comm=cfg.parallel.cp_comm))
        model = build_model(cfg.model, ctx)
        params = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))
        mine = shard_sequence(ids, dim=1, rank=state.cp_rank, size=state.cp)
        _, kept = kept_for_backward(model, mine, mine, besides=params)
        out.append((layout, kept, activation_bytes(cfg, "cpu")))
        dist.barrier()
        destroy_parallel()
    return out


def test_memory_estimate_follows_what_each_cp_mode_keeps_for_backward():
    """The pre-flight's activation estimate within 8% of the bytes autograd keeps (fp32, CPU, GQA with 2 kv heads:
    all_to_all repeats them at cp=4) at CP 1, 2 and 4 in both modes; the all-gathered keys and values are what
    all_gather keeps more, and it must be counted (without it CP=4 all_gather is 11% under)."""
    common = ["parallel.tp=1", "model.hidden=128", "model.heads=8", "model.kv_heads=2", "model.position=rotary"]
    common += ["train.seq_len=128", "train.micro_batch_size=2"]
    for layout, kept, estimated in run_distributed(_kept_and_estimated, 4, common, timeout=120)[0]:
        assert abs(estimated / kept - 1) < 0.08, (layout, kept, estimated)


def _largest_fp32_logits(chunk_elements: int):
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpframe.kernels import cross_entropy as kernels
    from tpframe.layers.context import shard_sequence
    from tpframe.models import BuildContext, build_model
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import initialize_parallel

    class Largest(TorchDispatchMode):  # the most elements of any fp32 tensor an op makes with the vocabulary's width
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == vocab:
                    Largest.most = max(Largest.most, t.numel())
            return out

    kernels.DEFAULT_CHUNK_ELEMENTS = chunk_elements  # a 128k-token sequence's chunking, at this size
    state = initialize_parallel(tp=1, cp=2)
    vocab = 512
    cfg = ModelConfig(vocab_size=vocab, hidden=32, layers=1, heads=4, max_seq_len=256)
    model = build_model(cfg, BuildContext(state.tp_comm, seed=3, cp_comm=state.cp_comm, dtype=torch.bfloat16))
    ids = shard_sequence(torch.randint(0, vocab, (2, 256)), dim=1, rank=state.cp_rank, size=2)
    with Largest():
        model(ids, ids).mean().backward()
    return Largest.most, ids.numel() * vocab


def test_fused_head_and_loss_never_hold_fp32_logits_of_the_whole_sequence():
    """bf16 training at CP=2: the head + loss keeps its logits in bf16; fp32 appears one chunk of rows at a time
    (kernels/cross_entropy.py's DEFAULT_CHUNK_ELEMENTS on CPU; a row at a time in the CUDA kernels), in forward
    and backward."""
    for most, whole in run_distributed(_largest_fp32_logits, 2, 16 * 512, timeout=120):
        assert 0 < most <= 16 * 512 < whole, (most, whole)


# -- CUDA ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_chunks_over_gathered_keys_attend_like_the_whole_sequence_on_cpu(fused):
    """`attend_local_chunks` over the whole sequence's keys in fp64 (the all_gather mode's blocks without a
    communicator, and the lower-right mask path), MHA and GQA, cp 2, 3 and 4: every rank's rows and query gradient,
    and the keys' and values' gradients summed over the ranks, equal whole-sequence attention's."""
    import torch.nn.functional as F

    from tpframe.layers.context import attend_local_chunks, shard_sequence

    g = torch.Generator().manual_seed(0)
    for nq, nkv, cp in ((4, 4, 2), (4, 2, 3), (8, 2, 4)):
        b, s, d = 2, 8 * cp, 8
        q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (nq, nkv, nkv))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        w = torch.randn(b, nq, s, d, generator=g, dtype=torch.float64)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nq)
        dq, dk, dv = torch.autograd.grad((ref * w).sum(), (q, k, v))
        dk_sum, dv_sum = torch.zeros_like(k), torch.zeros_like(v)
        for r in range(cp):
            mine = lambda t: shard_sequence(t, dim=2, rank=r, size=cp)  # noqa: E731
            ql, kf, vf = mine(q.detach()).requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()
            out = attend_local_chunks(ql, kf, vf, rank=r, size=cp, enable_gqa=nkv != nq, fused=fused)
            gq, gk, gv = torch.autograd.grad((out * mine(w)).sum(), (ql, kf, vf))
            assert (out - mine(ref)).abs().max().item() < 1e-6, (nq, nkv, cp, r)
            assert (gq - mine(dq)).abs().max().item() < 1e-6, (nq, nkv, cp, r)
            dk_sum, dv_sum = dk_sum + gk, dv_sum + gv
        assert (dk_sum - dk).abs().max().item() < 1e-6 and (dv_sum - dv).abs().max().item() < 1e-6, (nq, nkv, cp)


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("nkv", [16, 4])
def test_cuda_chunks_attend_like_the_whole_sequence_in_bf16(nkv, fused):
    """The merged two-block kernels (cuDNN on Hopper) and FlashAttention's lower-right causal mask, with and without
    GQA: every CP rank's rows and gradients equal whole-sequence attention's within bf16 rounding."""
    import torch.nn.functional as F

    from tpframe.layers.context import attend_local_chunks, shard_sequence

    g = torch.Generator(device="cuda").manual_seed(0)
    b, nq, s, d = 2, 16, 2048, 128
    q, k, v = (torch.randn(b, n, s, d, generator=g, device="cuda", dtype=torch.bfloat16) for n in (nq, nkv, nkv))
    w = torch.randn(b, nq, s, d, generator=g, device="cuda", dtype=torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nq)
    dq, dk, dv = torch.autograd.grad((ref.float() * w).sum(), (q, k, v))
    for cp in (2, 4):
        dk_sum, dv_sum = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for r in range(cp):
            mine = lambda t: shard_sequence(t, dim=2, rank=r, size=cp)  # noqa: E731
            ql = mine(q.detach()).requires_grad_()
            kf, vf = k.detach().requires_grad_(), v.detach().requires_grad_()
            out = attend_local_chunks(ql, kf, vf, rank=r, size=cp, enable_gqa=nkv != nq, fused=fused)
            gq, gk, gv = torch.autograd.grad((out.float() * mine(w)).sum(), (ql, kf, vf))
            assert (out.float() - mine(ref).float()).abs().max().item() < 2e-2, (cp, r)
            assert (gq.float() - mine(dq).float()).abs().max().item() < 5e-2, (cp, r)
            dk_sum += gk.float()
            dv_sum += gv.float()
        # the keys' gradient is the sum of every rank's contribution (the all-gather's reduce-scatter)
        assert (dk_sum - dk.float()).abs().max().item() < 0.25 and (dv_sum - dv.float()).abs().max().item() < 0.25, cp


DOCS = ["model.attention_mask=document", "model.eod_id=10"]  # each line of the synthetic corpus a document


def _cuda_train(tmp: str):
    out = {}
    for name, extra in (
        ("cp=1", ["parallel.cp=1", "train.micro_batch_size=2"]),
        ("cp=2", ["parallel.cp=2"]),
        ("cp=2 all_to_all", ["parallel.cp=2", A2A]),
        ("cp=1 documents", ["parallel.cp=1", "train.micro_batch_size=2", *DOCS]),
        ("cp=2 all_to_all documents", ["parallel.cp=2", A2A, *DOCS]),
    ):
        out[name] = [
            r["loss"]
            for r in train_in_process(
                [
                    "parallel.tp=1",
                    "train.dtype=bfloat16",
                    "model.position=rotary",
                    "model.kv_heads=2",
                    "model.hidden=128",
                    "model.heads=8",
                    "model.max_seq_len=256",
                    "train.seq_len=256",
                    "train.micro_batch_size=4",
                    *extra,
                    f"train.run_dir={tmp}/{name}",
                ]
            )
        ]
    return out


@pytest.mark.gpu(count=2)
def test_cuda_train_py_at_cp2_follows_dp2():
    """NCCL and FlashAttention: CP=2 in both cp_comm modes against DP=2 on the same global batch, bf16; all_to_all
    with packed documents (whole rows through the variable-length kernel) against DP=2 with them."""
    import tempfile

    losses = run_distributed(_cuda_train, 2, tempfile.mkdtemp(), backend="nccl", timeout=300)[0]
    for ref, name in (("cp=1", "cp=2"), ("cp=1", "cp=2 all_to_all"), ("cp=1 documents", "cp=2 all_to_all documents")):
        for a, b in zip(losses[ref], losses[name]):
            assert abs(a - b) < 2e-2 * abs(a), (name, losses)


def test_the_long_context_table_on_two_gpus_times_both_modes_and_scales_against_half_the_sequence(tmp_path):
    """benchmarks/long_context.py --compare --gpus 2 (the CP=2 table) on CPU: both tpframe modes at CP=2 with a
    scaling figure against one process at half the sequence, --layers passed to every run; --gpus 3 is refused."""
    import subprocess
    import sys

    from tests.training_utils import REPO

    results = tmp_path / "results.md"
    cmd = [sys.executable, "benchmarks/long_context.py", "--compare", "--shapes", "tiny", "--seqs", "64"]
    cmd += ["--layers", "1", "--results", str(results), "--logs", str(tmp_path)]
    bad = subprocess.run([*cmd, "--gpus", "3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not --gpus 3" in bad.stderr, bad.stderr
    done = subprocess.run([*cmd, "--gpus", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r.split(" | ")[2]: r.split(" | ") for r in results.read_text().splitlines() if r.startswith("| tiny")}
    for mode in CP_COMM_MODES:
        row = rows[f"CP=2, tpframe {mode}"]
        assert float(row[4].replace(",", "")) > 0 and float(row[8].rstrip(" |")) > 0, row  # tokens/s, scaling
    assert {"CP=1, one GPU, S=32", "CP=1, one GPU, S=64"} <= set(rows), rows
    assert (tmp_path / "long_context_logs.txt").read_text().count("'LAYERS': 1") == len(rows)


@pytest.mark.slow
def test_the_long_context_benchmark_trains_each_cp_mode_and_takes_overrides(tmp_path):
    """benchmarks/long_context.py --train (train.py's peak against the pre-flight's estimate) at CP=2 on CPU: a row
    per cp_comm mode with a measured throughput, and --set replaces the shape's own keys (one layer, not two)."""
    import re
    import subprocess
    import sys

    from tests.training_utils import REPO

    results = tmp_path / "results.md"
    cmd = [sys.executable, "benchmarks/long_context.py", "--train", "--gpus", "2", "--shapes", "tiny"]
    cmd += ["--seqs", "256", "--set", "model.layers=1", "--results", str(results), "--logs", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [ln for ln in results.read_text().splitlines() if ln.startswith("| tiny")]
    assert [r.split(" | ")[2] for r in rows] == list(CP_COMM_MODES), rows
    assert all(float(r.split(" | ")[3].replace(",", "")) > 0 for r in rows), rows  # tokens/s measured
    logs = (tmp_path / "long_context_logs.txt").read_text()
    sizes = re.findall(r"tpframe: ([\d.]+)M params \| world 2 = tp 1 x cp 2", logs)
    assert sizes == ["0.06", "0.06"], sizes  # one layer of the tiny shape (its two layers: 0.11M)
    assert "--set model.layers=1" in results.read_text()
