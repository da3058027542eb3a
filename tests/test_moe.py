"""Mixture of experts (tpframe/layers/moe.py) against plain computations: the layer's output, load-balancing
loss and gradients against a per-token loop (fp64); the layer split over TP (+SP) and EP against one process
holding every expert (fp64, to rounding); train.py's losses, gradient norms and weights over 10 steps at TP,
SP, DP, EP, CP, PP and recompute layouts against DP alone (fp32), and checkpoints that move between EP
layouts."""

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import assert_layouts_follow, train_in_process

H, F, E, K = 16, 24, 4, 2


def _naive(x: torch.Tensor, router: torch.Tensor, experts: dict, top_k: int, shared: tuple, bias=None):
    """Each token through its top-k experts and the shared expert, one at a time: (output [T, h], Switch aux
    loss, router z-loss). With `bias`: DeepSeek-V3's router (sigmoid scores, chosen with the bias added)."""
    swiglu = lambda w, v: w[2] @ (torch.nn.functional.silu(w[0] @ v) * (w[1] @ v))  # noqa: E731
    logits = x @ router.t()
    if bias is None:
        probs = torch.softmax(logits, dim=-1)
        top_p, top_i = probs.topk(top_k, dim=-1)
    else:
        probs = torch.sigmoid(logits)
        top_i = (probs.detach() + bias).topk(top_k, dim=-1).indices
        top_p = probs.gather(1, top_i)
        probs = probs / probs.sum(-1, keepdim=True)
    weights = top_p / top_p.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        row = swiglu(shared, x[t])
        for j in range(top_k):
            row = row + weights[t, j] * swiglu(experts[int(top_i[t, j])], x[t])
        rows.append(row)
    share = torch.bincount(top_i.flatten(), minlength=router.shape[0]).double() / (x.shape[0] * top_k)
    z = torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()
    return torch.stack(rows), router.shape[0] * (share * probs.mean(0)).sum(), z


def _solo_comm():
    import torch.distributed as dist

    from tpframe.comm import Communicator

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank builds every group
    return Communicator(groups[dist.get_rank()], backend="nccl", device=torch.device("cpu"))


def test_layer_equals_a_per_token_loop_with_its_load_balancing_gradient():
    run_distributed(_loop_worker, 1)


def _loop_worker():
    from tpframe.layers.moe import MoE

    torch.manual_seed(0)
    moe = MoE(
        H,
        F,
        E,
        K,
        activation="swiglu",
        aux_loss_coeff=0.1,
        z_loss_coeff=0.05,
        shared_ffn_hidden=20,
        comm=_solo_comm(),
        dtype=torch.float64,
    )
    x = torch.randn(6, 2, H, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 2, H, dtype=torch.float64)
    (moe(x) * g).sum().backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
    ref_x = x.detach().clone().requires_grad_()
    mlp = lambda name: (*params[f"{name}.fc1.weight"].chunk(2), params[f"{name}.fc2.weight"])  # noqa: E731
    y, aux, z = _naive(
        ref_x.view(-1, H), params["router.weight"], {e: mlp(f"experts.{e}") for e in range(E)}, K, mlp("shared")
    )
    ((y * g.view(-1, H)).sum() + 0.1 * aux + 0.05 * z).backward()
    assert torch.allclose(moe(x).view(-1, H), y, atol=1e-12)
    assert torch.allclose(moe.last_aux_loss, aux.detach(), atol=1e-12)
    assert torch.allclose(moe.last_z_loss, z.detach(), atol=1e-12)
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-12)
    for n, p in moe.named_parameters():
        assert torch.allclose(p.grad, params[n].grad, atol=1e-12), n
    assert params["router.weight"].grad.abs().sum() > 0
    with torch.no_grad():  # generation's path for a few tokens (every expert on every token) gives the same
        assert torch.allclose(moe(x).view(-1, H), y, atol=1e-12)
        moe.eval()
        big = torch.randn(40, 2, H, dtype=torch.float64)  # 80 tokens: routed
        small = torch.cat([moe(chunk) for chunk in big.split(20)])  # 40 tokens each: every expert
        assert torch.allclose(moe(big), small, atol=1e-12)


def test_sigmoid_router_with_expert_bias_equals_the_loop_and_balances_once_per_micro_batch():
    run_distributed(_bias_worker, 1)


def _bias_worker():
    from tpframe.layers.moe import MoE, reset_expert_load, update_expert_biases
    from tpframe.parallel.recompute import recompute

    torch.manual_seed(0)
    moe = MoE(
        H,
        F,
        E,
        K,
        activation="swiglu",
        aux_loss_coeff=0.1,
        score="sigmoid",
        expert_bias=True,
        comm=_solo_comm(),
        dtype=torch.float64,
    )
    assert moe.expert_bias.dtype == torch.float32 and not moe.expert_bias.requires_grad
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.3, 0.0, -0.3, 0.1]))  # enough to change choices
    x = torch.randn(6, 2, H, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 2, H, dtype=torch.float64)
    (moe(x) * g).sum().backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters() if n != "expert_bias"}
    ref_x = x.detach().clone().requires_grad_()
    mlp = lambda name: (*params[f"{name}.fc1.weight"].chunk(2), params[f"{name}.fc2.weight"])  # noqa: E731
    zero = tuple(torch.zeros_like(w) for w in mlp("experts.0"))
    y, aux, _ = _naive(
        ref_x.view(-1, H),
        params["router.weight"],
        {e: mlp(f"experts.{e}") for e in range(E)},
        K,
        zero,
        bias=moe.expert_bias.double(),
    )
    ((y * g.view(-1, H)).sum() + 0.1 * aux).backward()
    assert torch.allclose(moe(x).view(-1, H), y, atol=1e-12) and torch.allclose(x.grad, ref_x.grad, atol=1e-12)
    for n, p in params.items():  # (an expert no token chose has no gradient in the loop, zeros in the layer)
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(dict(moe.named_parameters())[n].grad, want, atol=1e-12), n
    with torch.no_grad():  # generation's dense path chooses with the bias too
        assert torch.allclose(moe(x).view(-1, H), y, atol=1e-12)
    # the slots are counted once per training micro-batch: recompute runs the forward twice, evaluation none
    chosen = (
        (torch.sigmoid(x.detach().view(-1, H) @ params["router.weight"].detach().t()) + moe.expert_bias).topk(K).indices
    )
    want = torch.bincount(chosen.flatten(), minlength=E)
    reset_expert_load([moe])
    moe(x).sum().backward()
    recompute(lambda v: moe(v), x, preserve_rng=False).sum().backward()
    moe.eval()
    moe(x)
    assert torch.equal(moe.expert_load, 2 * want), (moe.expert_load, want)
    before = moe.expert_bias.clone()
    update_expert_biases([moe], None, rate=0.01)
    step = torch.sign(want.double().mean() - want.double()).float() * 0.01
    assert torch.equal(moe.expert_bias, before + step) and step.abs().sum() > 0 and not moe.expert_load.any()


# -- the layer split over TP and EP, 4 processes -------------------------------------------------------------


def _split_worker(tp: int, ep: int, sp: bool):
    import torch.distributed as dist

    from tests.reference import gather_full_tensors, scatter_to_sp
    from tpframe.layers.moe import MoE
    from tpframe.parallel import destroy_parallel, initialize_parallel

    solo = _solo_comm()
    state = initialize_parallel(tp=tp, ep=ep)
    s, b = 8, 2
    data = [
        torch.randn(s, b, H, generator=torch.Generator().manual_seed(10 + d), dtype=torch.float64)
        for d in range(state.dp)
    ]
    grads = [
        torch.randn(s, b, H, generator=torch.Generator().manual_seed(20 + d), dtype=torch.float64)
        for d in range(state.dp)
    ]

    def build(comm, ep_comm):
        torch.manual_seed(7)
        return MoE(
            H,
            F,
            8,
            K,
            activation="swiglu",
            aux_loss_coeff=0.1,
            z_loss_coeff=0.05,
            shared_ffn_hidden=F,
            sequence_parallel=sp and comm.size > 1,
            comm=comm,
            ep_comm=ep_comm,
            dtype=torch.float64,
        )

    moe, ref = build(state.tp_comm, state.ep_comm), build(solo, None)
    # this rank: its DP rank's tokens (its sequence slice under SP); the objective is the mean over DP ranks
    x = data[state.dp_rank].clone().requires_grad_()
    local_x = scatter_to_sp(x, state.tp_comm) if moe.sequence_parallel else x
    local_g = grads[state.dp_rank]
    if moe.sequence_parallel:
        local_g = local_g.chunk(tp)[state.tp_rank]
    moe.aux_loss_scale = 1.0 / state.dp
    out = moe(local_x)
    (out * local_g).sum().div(state.dp).backward()
    ref.aux_loss_scale = 1.0 / state.dp
    for d in range(state.dp):
        (ref(data[d]) * grads[d]).sum().div(state.dp).backward()
    # what ddp does: router (partial over TP) summed over TP; sums over the replicas
    router = moe.router.weight
    router.grad = state.tp_comm.all_reduce(router.grad)
    dist.all_reduce(router.grad, group=state.dp_group)
    for p in moe.experts.parameters():
        dist.all_reduce(p.grad, group=state.edp_group)
    for p in moe.shared.parameters():  # dense: TP-split, replicated over every DP rank
        dist.all_reduce(p.grad, group=state.dp_group)
    mine = gather_full_tensors(moe, state.tp_comm, "grad")
    full = gather_full_tensors(ref, solo, "grad")
    errors = {n: (mine[n] - full[n]).abs().max().item() for n in mine}
    expected_out = ref(data[state.dp_rank])
    if moe.sequence_parallel:
        expected_out = expected_out.chunk(tp)[state.tp_rank]
    errors["output"] = (out - expected_out).abs().max().item()
    names = sorted(mine)
    from tpframe.parallel.pipeline import pipeline_numel

    # the start-up line's parameter count: every EP rank's experts, TP-unsplit (the one-process layer's)
    counts = (pipeline_numel(moe, state), sum(p.numel() for p in ref.parameters()))
    destroy_parallel()
    return errors, names, counts


@pytest.mark.parametrize("tp,ep,sp", [(1, 4, False), (2, 2, True), (2, 2, False), (4, 1, True), (1, 2, False)])
def test_layer_over_tp_and_ep_equals_one_process_with_every_expert(tp, ep, sp):
    results = run_distributed(_split_worker, 4, tp, ep, sp)
    held = set()
    for errors, names, (counted, every) in results:
        assert max(errors.values()) < 1e-12, errors
        assert counted == every, (counted, every)
        held |= {n.split(".")[1] for n in names if n.startswith("experts.")}
    assert held == {str(e) for e in range(8)}  # every expert lives somewhere, under its global index


# -- train.py: 10 steps on 4 processes ------------------------------------------------------------------------

# name: overrides. The reference is DP=4 (DP alone is exact: ddp averages the replicas' gradients). Every layout
# keeps micro-batches of 2 sequences, so each load-balancing loss sees the same tokens (whole sequences: CP
# ranks sum their counts), and evaluation the same 16 held-out sequences (DP=2: twice the micro-batches).
# A large aux coefficient makes a mis-scaled load-balancing gradient show.
DP2 = "train.eval_steps=4"
LAYOUTS = {
    "ep=4": ["parallel.ep=4"],
    "tp=2 + SP x dp=2": ["parallel.tp=2", "parallel.sequence_parallel=true", DP2],
    # the copies of every weight compared every 3 steps in three layouts (train.compare_replicas_every): none differ
    "tp=2 x ep=2 zero1": [
        "parallel.tp=2",
        "parallel.ep=2",
        "parallel.dp_strategy=zero1",
        DP2,
        "train.compare_replicas_every=3",
    ],
    "cp=2 x dp=2 x ep=4": ["parallel.cp=2", "parallel.ep=4", DP2],
    "pp=2 x ep=2": ["parallel.pp=2", "parallel.ep=2", DP2, "train.compare_replicas_every=3"],
    "ep=2 full recompute": ["parallel.ep=2", "parallel.activation_checkpointing=full"],
    "ep=2 selective": ["parallel.ep=2", "parallel.activation_checkpointing=selective"],
    # experts sharded over their 2 replicas, the rest over 4; small buckets
    "ep=2 zero1": [
        "parallel.ep=2",
        "parallel.dp_strategy=zero1",
        "parallel.grad_bucket_mb=0.01",
        "train.compare_replicas_every=3",
    ],
    "ep=2 fsdp": ["parallel.ep=2", "parallel.dp_strategy=fsdp"],  # each expert an FSDP unit over its 2 replicas
    # one replica per expert (ep = dp): FSDP2 runs no collective for the experts and must divide by dp once
    "ep=4 fsdp": ["parallel.ep=4", "parallel.dp_strategy=fsdp"],
}
# DeepSeek-V3's router (sigmoid, expert bias at a rate that changes choices within 10 steps): every layout must
# count the same slots (summed over DP and CP, per PP stage, once under recompute) and checkpoint the biases
COMMON = [
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden=32",
    "model.moe_aux_loss=0.1",
    "model.moe_shared_ffn=32",
    "model.moe_z_loss=0.01",
    "model.moe_router_score=sigmoid",
    "model.moe_expert_bias=true",
    "model.moe_expert_bias_rate=0.01",
    "model.activation=swiglu",
    "model.bias=false",
    "model.position=rotary",
    "train.micro_batch_size=2",
    "train.global_batch_size=16",
    "train.eval_interval=5",
    "train.eval_steps=2",
    "parallel.tp=1",
]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _train_layouts(tmp: str):
    out = {}
    ref = train_in_process([*COMMON, f"train.run_dir={tmp}/ref"], keep_trainer=True)
    out["ref"] = (ref.history, _weights(ref))
    for name, extra in LAYOUTS.items():
        trainer = train_in_process(
            [*COMMON, *extra, f"train.run_dir={tmp}/{name}", "checkpoint.interval=5"], keep_trainer=True
        )
        plain = not any(k in " ".join(extra) for k in ("tp=2", "pp=2", "fsdp"))  # whole parameters (some experts) here
        if (
            trainer.weight_check is not None
        ):  # steps 3, 6 and 9 compared, the experts over their 2 replicas at ep=2 dp=4
            assert trainer.weight_check.checks == 3, name
            assert ("expert-data-parallel (2 copies)" in trainer.weight_check.compares) == (name == "ep=2 zero1"), name
        out[name] = (trainer.history, _weights(trainer) if plain else None)
    # the step-5 checkpoint of the TP=2 x EP=2 zero1 run resumes with ddp without EP, at EP=4, and at TP=2 x DP=2
    saved = f"{tmp}/tp=2 x ep=2 zero1/checkpoints/step_00000005"
    import json

    assert json.loads(open(f"{saved}/meta.json").read())["layout"] == {
        "world": 4,
        "tp": 2,
        "cp": 1,
        "dp": 2,
        "pp": 1,
        "ep": 2,
    }
    for name, extra in (
        ("resumed at dp=4", []),
        ("resumed at ep=4", LAYOUTS["ep=4"]),
        ("resumed at tp=2 x dp=2", ["parallel.tp=2", DP2]),
    ):
        history = train_in_process([*COMMON, *extra, f"checkpoint.load={saved}", f"train.run_dir={tmp}/{name}"])
        out[name] = (history, None)
    # its consolidated export starts new runs at dp=4 and at ep=4 (each EP rank takes only its experts)
    import torch.distributed as dist

    from tpframe.checkpoint.export import export_consolidated

    exported = f"{tmp}/step5_rank{dist.get_rank()}.safetensors"
    export_consolidated(saved, exported)
    for name, extra in (("init at dp=4", []), ("init at ep=4", LAYOUTS["ep=4"])):
        out[name] = (
            train_in_process(
                [*COMMON, *extra, f"checkpoint.init_from={exported}", "train.steps=2", f"train.run_dir={tmp}/{name}"]
            ),
            None,
        )
    return out


@pytest.mark.slow
def test_train_py_moe_layouts_equal_data_parallel_and_resume_across_ep(tmp_path):
    results = run_distributed(_train_layouts, 4, str(tmp_path), timeout=600)[-1]  # rank 3: on the last stage
    ref_history, ref_weights = results.pop("ref")
    ref = {r["step"]: r for r in ref_history}
    assert len(ref) == 10 and ref[10]["loss"] < ref[1]["loss"]
    assert all(0.5 < r["moe_aux_loss"] < 4.0 for r in ref_history)  # logged: near 1 when balanced
    assert all(1.0 <= r["moe_load_max"] < 4.0 for r in ref_history)  # the most loaded expert over the mean
    biases = [v for n, v in ref_weights.items() if n.endswith("mlp.expert_bias")]
    assert len(biases) == 2 and all(b.abs().max() > 0.005 for b in biases)  # moved, and compared below
    assert all(r["moe_z_loss"] > 0 for r in ref_history)
    (init_dp, _), (init_ep, _) = results.pop("init at dp=4"), results.pop("init at ep=4")
    assert init_dp[0]["loss"] < ref[1]["loss"] - 0.5  # trained weights, not a fresh model
    for a, b in zip(init_ep, init_dp, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)
    assert_layouts_follow(ref_history, results, grad_norm_rel=1e-4)
    for name, (_history, weights) in results.items():
        if weights is not None:
            assert any(".experts." in n for n in weights)
            for n, value in weights.items():
                error = ((value - ref_weights[n]).norm() / ref_weights[n].norm()).item()
                assert error < 1e-5, (name, n, error)


def _bias_export_and_generate(root: str):
    import sys

    from tests.training_utils import REPO

    sys.path.insert(0, REPO)
    import generate as cli
    from tpframe.checkpoint.export import export_consolidated

    trainer = train_in_process(
        [*COMMON, "train.steps=3", "checkpoint.save_at_end=true", f"train.run_dir={root}"], keep_trainer=True
    )
    step = f"{root}/checkpoints/step_00000003"
    tensors = export_consolidated(step, f"{root}/model.safetensors")
    biases = {n: p.detach() for n, p in trainer.model.named_parameters() if n.endswith("expert_bias")}
    args = ["--prompt", "the cat", "--max-new-tokens", "6", "--greedy", "--ignore-eos"]
    texts = [
        cli.run(cli.prepare(["--checkpoint", src, *args]))[0]["token_ids"]
        for src in (step, f"{root}/model.safetensors")
    ]
    return biases, {n: tensors[n] for n in biases}, texts


def test_expert_biases_travel_in_exports_and_generation(tmp_path):
    biases, exported, (from_checkpoint, from_export) = run_distributed(_bias_export_and_generate, 1, str(tmp_path))[0]
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases.values())
    assert all(torch.equal(exported[n], b) and exported[n].dtype == torch.float32 for n, b in biases.items())
    assert from_checkpoint == from_export and len(from_checkpoint) == 6


# -- CUDA ---------------------------------------------------------------------------------------------------


def _cuda_grouped_vs_loop(recompute_activation: bool):
    from tpframe.layers.moe import MoE

    torch.manual_seed(0)
    moe = MoE(
        256, 384, 8, 2, activation="swiglu", aux_loss_coeff=0.01, comm=_solo_comm(), dtype=torch.bfloat16, device="cuda"
    )
    x = torch.randn(512, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    results = []
    for grouped in (True, False):
        moe._grouped = (lambda xs: True) if grouped else (lambda xs: False)
        out = moe(x, recompute_activation=recompute_activation)
        grads = torch.autograd.grad(out, [x, *moe.parameters()], g)
        results.append((out.float(), [t.float() for t in grads]))
    (out_a, grads_a), (out_b, grads_b) = results
    worst = max([((a - b).abs().max() / b.abs().max()).item() for a, b in zip([out_a, *grads_a], [out_b, *grads_b])])
    return worst


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("recompute_activation", [False, True], ids=["plain", "selective"])
def test_cuda_grouped_gemm_experts_equal_the_per_expert_loop_in_bf16(recompute_activation):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm in bf16 needs Hopper or newer")
    worst = run_distributed(_cuda_grouped_vs_loop, 1, recompute_activation, backend="nccl")[0]
    assert worst < 2e-2, worst  # bf16: the two paths round their GEMMs differently


MOE_GPU = [
    "parallel.tp=1",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden=64",
    "model.moe_shared_ffn=64",
    "model.moe_z_loss=0.001",
    "model.activation=swiglu",
    "model.bias=false",
    "model.position=rotary",
    "train.dtype=bfloat16",
    "train.steps=8",
    "optim.grad_clip=0",
]


ROUTERS = {
    "softmax": [],
    "sigmoid+bias": ["model.moe_router_score=sigmoid", "model.moe_expert_bias=true", "model.moe_expert_bias_rate=0.01"],
}


def _moe_eager_compiled_graphed(root: str, router: list[str]):
    from tpframe.layers.moe import MoE

    out = {}
    for name, extra in {
        "eager": [],
        "compile": ["train.compile=true"],
        "graph": ["train.cuda_graph=true"],
        "compile+graph": ["train.compile=true", "train.cuda_graph=true"],
    }.items():
        torch._dynamo.reset()
        trainer = train_in_process([*MOE_GPU, *router, *extra, f"train.run_dir={root}/{name}"], keep_trainer=True)
        bias = trainer.model.blocks["0"].mlp.expert_bias
        out[name] = {
            "losses": [r["loss"] for r in trainer.history],
            "aux": [r["moe_aux_loss"] for r in trainer.history],
            "captured": getattr(trainer.forward_backward, "captured", None),
            "bias_moved": None if bias is None else float(bias.abs().max()),
        }
        if name == "eager":  # a compiled MoE block traces whole: the grouped GEMMs need no host sync
            block = trainer.model.blocks["0"]
            assert isinstance(block.mlp, MoE)
            ids = torch.randint(0, 256, (4, 32), device="cuda")
            x = trainer.model.embed(ids)
            out["graph_breaks"] = torch._dynamo.explain(block)(x, trainer.model.rotary(32, x.dtype)).graph_break_count
    return out


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("router", list(ROUTERS))
def test_cuda_moe_trains_compiled_and_cuda_graphed_like_eager(tmp_path, router):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm in bf16 needs Hopper or newer")
    out = run_distributed(_moe_eager_compiled_graphed, 1, str(tmp_path), ROUTERS[router], backend="nccl", timeout=600)[
        0
    ]
    assert out.pop("graph_breaks") == 0
    eager = out.pop("eager")
    assert eager["losses"][-1] < eager["losses"][0] - 0.5, "the runs must really train"
    for name, run in out.items():
        assert run["captured"] is (True if "graph" in name else None), name
        if ROUTERS[router]:  # the slots were counted in the compiled and captured backward, and the biases moved
            assert run["bias_moved"] >= 0.01 and eager["bias_moved"] >= 0.01, (name, run["bias_moved"])
        for step, (a, b) in enumerate(zip(run["losses"], eager["losses"]), 1):
            assert abs(a - b) <= 2e-2 * abs(b), f"{name} step {step}: loss {a!r} vs eager {b!r}"  # bf16 rounding
        for step, (a, b) in enumerate(zip(run["aux"], eager["aux"]), 1):
            assert abs(a - b) <= 5e-2 * abs(b), f"{name} step {step}: load-balancing loss {a!r} vs eager {b!r}"
