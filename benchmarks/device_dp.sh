#!/bin/bash
# One device call on nvidia-h200-x2 (repo root): the GPU training tests, then the data-parallel benchmark, as the
# issue asks (micro-batch 8, activations dominate the peak) and with activation checkpointing (CKPT=1: the
# optimizer state dominates, where ZeRO-1's halving shows in the peak). SKIP_TESTS=1 skips the tests.
# PROFILE_ONLY=1: only the gradient-overlap question, in about 8 minutes: the bucket-averaging GPU test, then
# DP=1 (alone, and on every GPU at once: each GPU's own speed) and ddp with overlap off, on, and with the copy-engine
# sync, each of the last two also on high-priority streams (CKPT=1), each with a profiled step (traces under $OUT/dp_prof) whose GPU timeline says how long the
# collectives ran and how much of that no computation hid; benchmarks/dp_timeline.py then compares the traces.
# PEER=1: is the gap ours or the machine's? tpframe's DP=1 and overlapped ddp beside PyTorch's own DP on the same
# model (benchmarks/peer_dp.py: DDP nanoGPT's way, FSDP2 torchtitan's way, and the peer's DP=1), and ddp with the
# gradients reduced in bf16 (half the bytes: does the gap halve?), CKPT=1, a profiled step each, then the timeline
# split against each side's DP=1, then ddp with NCCL on 8 channels; about 9 minutes.
# BUCKETS=1: does the bucket size move the gap? DP=1 and overlapped ddp with buckets of 40 MiB (ours), 160 MiB
# (Megatron-Core's 40M elements: fewer, larger collectives, so fewer points where the ranks wait for each other, and a
# longer last bucket after the backward) and 10 MiB (the other way), CKPT=1; about 5 minutes.
# COPY_ENGINE=1: the copy-engine gradient sync's question, in about 9 minutes: its 2-GPU tests and the DP tests,
# then DP=1, ddp and zero1 with the NCCL and the copy-engine sync (CKPT=1), then GPT-125M CUDA-graphed (GRAPH=1).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/env.txt
if [ "${COPY_ENGINE:-0}" = 1 ]; then
  S=$SECONDS
  timeout 150 python3 -m pytest -q tests/test_copy_engine_gpu.py -p no:cacheprovider -rs -x 2>&1 | tail -4
  timeout 60 python3 -m pytest -q tests/test_gpu_training.py -k "every_dp_strategy or average_inside" \
    -p no:cacheprovider -rs 2>&1 | tail -3
  CKPT=1 APPEND=0 ROW_TIMEOUT=90 ROWS="DP=1;ddp, overlap on;ddp, overlap on, copy-engine sync;zero1;zero1, copy-engine sync" \
    timeout $((430 - (SECONDS - S))) python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_ce.log | grep -v "^W1"
  # GPT-125M with each micro-batch replayed from a CUDA graph: NCCL's sync after the replay, the copy-engine one inside
  GRAPH=1 LAYERS=12 HIDDEN=768 HEADS=12 SEQ=1024 MB=16 STEPS=20 APPEND=0 ROW_TIMEOUT=60 \
    ROWS="DP=1;ddp, overlap on;ddp, overlap on, copy-engine sync;zero1, copy-engine sync" \
    timeout $((560 - (SECONDS - S))) python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_ce_graph.log | grep -v "^W1"
  exit 0
fi
if [ "${BUCKETS:-0}" = 1 ]; then
  S=$SECONDS
  for mb in 40 160 10; do
    BUCKET_MB=$mb CKPT=1 STEPS=8 ROW_TIMEOUT=150 ROWS="DP=1;ddp, overlap on" \
      timeout $((560 - (SECONDS - S))) python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_bucket$mb.log | tail -5
  done
  cp benchmarks/RESULTS.md $OUT/RESULTS.md
  exit 0
fi
if [ "${PEER:-0}" = 1 ]; then
  CKPT=1 STEPS=8 ROWS="DP=1;ddp, overlap on;ddp, overlap on, bf16 reduce;torch peer, DP=1;torch DDP peer (nanoGPT's way);torch FSDP2 peer (torchtitan's way)" \
    PROFILE=$OUT/dp_peer timeout ${T_BENCH:-480} python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_peer.log | tail -16
  python3 benchmarks/dp_timeline.py $OUT/dp_peer --base ddp-overlap1-nccl-dp1 2>&1 | tee $OUT/dp_peer_timeline.txt | tail -30
  python3 benchmarks/dp_timeline.py $OUT/dp_peer --base peer-ddp-dp1 2>&1 | tee -a $OUT/dp_peer_timeline.txt | tail -30
  # NCCL on fewer channels (fewer CTAs, so fewer of the persistent GEMMs' SMs held): slower transfers, less contention
  NCCL_MAX_NCHANNELS=8 CKPT=1 STEPS=8 ROWS="DP=1;ddp, overlap on" timeout 150 python3 benchmarks/data_parallel.py 2>&1 \
    | tee $OUT/dp_nch8.log | tail -5
  cp benchmarks/RESULTS.md $OUT/RESULTS.md
  exit 0
fi
if [ "${PROFILE_ONLY:-0}" = 1 ]; then
  timeout 90 python3 -m pytest -q tests/test_gpu_training.py -k nccl_gradient -p no:cacheprovider -rs 2>&1 | tail -3
  # each GPU's own DP=1 speed (a DP group runs at its slowest GPU's pace), then the profiled DP=2 rows
  CKPT=1 STEPS=8 ROWS="DP=1;DP=1 on every GPU at once (no DP traffic);ddp, overlap off;ddp, overlap on;ddp, overlap on, high-priority stream;ddp, overlap on, copy-engine sync;ddp, overlap on, copy-engine sync, high-priority streams" \
    PROFILE=$OUT/dp_prof timeout ${T_BENCH:-470} python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_prof.log | tail -20
  python3 benchmarks/dp_timeline.py $OUT/dp_prof 2>&1 | tee $OUT/dp_timeline.txt | tail -40
  cp benchmarks/RESULTS.md $OUT/RESULTS.md
  exit 0
fi
[ "${SKIP_TESTS:-0}" = 1 ] || timeout ${T_TESTS:-200} python3 -m pytest -q tests/test_gpu_training.py -p no:cacheprovider -rs 2>&1 | tee $OUT/gpu_tests.log | tail -8
timeout ${T_BENCH:-330} python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_bench.log | tail -14
CKPT=1 timeout ${T_BENCH_CKPT:-300} python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_bench_ckpt.log | tail -14
cp benchmarks/RESULTS.md $OUT/RESULTS.md
