"""Vocab-parallel embedding and cross entropy against F.embedding / F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.reference import assert_close, leaf, tol_for

S, B, H = 8, 3, 16


def _embedding_matches_dense(vocab, multiple):
    from tpframe.layers import VocabParallelEmbedding
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    tp, r = comm.size, comm.rank
    for dtype in (torch.float32, torch.bfloat16):
        for sp in (False, True):
            case = f"embedding V={vocab} multiple={multiple} dtype={dtype} sp={sp} tp={tp}"
            layer = VocabParallelEmbedding(vocab, H, sequence_parallel=sp, pad_to_multiple_of=multiple, dtype=dtype)
            padded = layer.padded_num_embeddings
            assert padded % tp == 0 and padded % multiple == 0 and padded >= vocab
            assert layer.weight.shape == (padded // tp, H)
            torch.manual_seed(99)
            table, g = torch.randn(vocab, H), torch.randn(S, B, H)
            ids = torch.randint(0, vocab, (S, B))
            ids[0, 0], ids[1, 0] = 0, vocab - 1  # both ends of the vocabulary
            table_ref = leaf(table, dtype)
            y_ref = F.embedding(ids, table_ref)
            y_ref.backward(g.to(dtype))
            with torch.no_grad():
                layer.weight.copy_(F.pad(table, (0, 0, 0, padded - vocab)).chunk(tp, 0)[r])
            y = layer(ids)
            y.backward((g.chunk(tp, 0)[r] if sp else g).to(dtype))
            tol = tol_for(dtype)
            assert_close(y, y_ref.chunk(tp, 0)[r] if sp else y_ref, tol, f"{case}: output")
            grad_ref = F.pad(table_ref.grad, (0, 0, 0, padded - vocab)).chunk(tp, 0)[r]
            assert_close(layer.weight.grad, grad_ref, tol, f"{case}: weight grad")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_matches_dense(tp):
    run_distributed(_embedding_matches_dense, tp, 50, 1)  # 50 needs padding at tp=4
    run_distributed(_embedding_matches_dense, tp, 37, 8) if tp == 4 else None


def test_padded_vocab_size():
    from tpframe.layers import padded_vocab_size

    assert padded_vocab_size(50257, 1, 128) == padded_vocab_size(50257, 8, 128) == 50304
    assert padded_vocab_size(50, 4) == 52 and padded_vocab_size(48, 4) == 48
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        padded_vocab_size(0, 2)


def _cross_entropy_matches_dense():
    from tpframe.layers import vocab_parallel_cross_entropy
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    tp, r = comm.size, comm.rank
    for vocab, padded in ((48, 48), (50, 52), (45, 48)):  # exact, and vocabularies that need padding
        for smoothing in (0.0, 0.1):
            for dtype in (torch.float32, torch.bfloat16):
                case = f"CE V={vocab} padded={padded} smoothing={smoothing} dtype={dtype} tp={tp}"
                torch.manual_seed(5)
                logits = torch.randn(S, B, padded) * 4 + 30  # large offsets: needs the max subtraction
                target = torch.randint(0, vocab, (S, B))
                target[0, :] = -100  # ignored tokens
                target[1, 0] = vocab - 1
                g = torch.randn(S, B)
                ref_logits = leaf(logits[..., :vocab], dtype)
                loss_ref = F.cross_entropy(
                    ref_logits.float().reshape(-1, vocab),
                    target.reshape(-1),
                    reduction="none",
                    label_smoothing=smoothing,
                ).view(S, B)
                loss_ref.backward(g)
                local = leaf(logits.chunk(tp, -1)[r], dtype)
                before = local.detach().clone()
                loss = vocab_parallel_cross_entropy(
                    local, target, label_smoothing=smoothing, comm=comm, vocab_size=vocab if vocab != padded else None
                )
                assert loss.dtype == torch.float32 and loss.shape == (S, B)
                loss.backward(g)
                assert torch.equal(local.detach(), before), f"{case}: logits were modified in place"
                assert (loss[0] == 0).all() and (local.grad[0] == 0).all(), f"{case}: ignored tokens contribute"
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                assert_close(loss, loss_ref, tol, f"{case}: loss")
                grad_ref = F.pad(ref_logits.grad, (0, padded - vocab)).chunk(tp, -1)[r]
                assert_close(local.grad, grad_ref, tol_for(dtype), f"{case}: logits grad")
                if vocab != padded:
                    start = r * (padded // tp)
                    pad_cols = [c - start for c in range(max(start, vocab), start + padded // tp)]
                    assert (local.grad[..., pad_cols] == 0).all(), f"{case}: padding columns got gradient"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_dense(tp):
    run_distributed(_cross_entropy_matches_dense, tp)


def _cross_entropy_bad_input():
    from tpframe.layers import vocab_parallel_cross_entropy
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=1).tp_comm
    messages = []
    for call in (
        lambda: vocab_parallel_cross_entropy(torch.randn(4, 10), torch.zeros(5, dtype=torch.long), comm=comm),
        lambda: vocab_parallel_cross_entropy(
            torch.randn(4, 10), torch.zeros(4, dtype=torch.long), label_smoothing=1.5, comm=comm
        ),
        lambda: vocab_parallel_cross_entropy(
            torch.randn(4, 10), torch.zeros(4, dtype=torch.long), vocab_size=11, comm=comm
        ),
    ):
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_cross_entropy_bad_input_is_a_clear_error():
    messages = run_distributed(_cross_entropy_bad_input, 1)[0]
    assert len(messages) == 3
    assert "logits (4, 10) and target (5,)" in messages[0]
    assert "label_smoothing must be in [0, 1), got 1.5" in messages[1]
    assert "vocab_size=11" in messages[2]
