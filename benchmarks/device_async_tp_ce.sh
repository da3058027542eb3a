#!/bin/bash
# One device call on nvidia-h200-x2 (repo root; carry the peers as .peers): GPT-1.3B TP=2 + SP forward+backward,
# async TP by copy engines against the plain path, eager, in one CUDA graph, and compiled in one graph, beside the
# DTensor peer (torch.compile + async TP); first the 2-GPU layer test and the Trainer's (eager and CUDA-graphed).
# Every step bounded by a deadline (END s).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NO_APPEND=1
export PYTHONPATH=. TP=2 SP=1 STEPS=10 LAYERS=24 HIDDEN=2048 HEADS=16 SEQ=2048 MB=8
S=$SECONDS; END=${END:-450}
cap() { local l=$((END - (SECONDS - S))); [ $l -lt 5 ] && l=5; [ $l -lt $1 ] && echo $l || echo $1; }
run() {
  env "$@" timeout $(cap 120) python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpt.py 2>&1 \
    | tee -a $OUT/gpt.log | grep -E "RESULT|rror" | cut -c1-400
  echo "  ($* at $((SECONDS - S)) s)"
}
timeout $(cap 60) python3 -m pytest -q tests/test_perf_gpu.py -k async_tp_layers_match -p no:cacheprovider 2>&1 | tail -2
timeout $(cap 120) python3 -m pytest -q tests/test_gpu_training.py -k copy_engine_async_tp -p no:cacheprovider 2>&1 | tail -2
run ASYNC_TP=0
run ASYNC_TP=copy_engine
run ASYNC_TP=copy_engine GRAPH=1
run ASYNC_TP=0 GRAPH=1
COMPILE=1 ASYNC_TP=1 timeout $(cap 150) python3 -m torch.distributed.run --nproc-per-node 2 .peers/bench_dtensor_gpt.py \
  2>&1 | tee -a $OUT/peer.log | grep RESULT
run COMPILE=1 GRAPH=1 ASYNC_TP=copy_engine
run COMPILE=1 GRAPH=1 ASYNC_TP=0
