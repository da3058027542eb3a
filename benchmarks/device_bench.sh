#!/bin/bash
# One device call on nvidia-h200-x2 (repo root): GPT-1.3B TP=2 + SP forward+backward eager, eager + async TP (ring, symm_mem) and
# compiled (benchmarks/gpt.py, side by side), the same shape's full optimizer step (benchmarks/pipeline.py tp-sp,
# one micro-batch of 8, fwdbwd=1: the train step against the same model's bare forward+backward), then the
# pipeline schedules next to TP=2 + SP and DP=2 at the same global batch. IDLE=1: the GPU idle time of a step
# (benchmarks/gpt.py PROFILE) at GPT-1.3B and GPT-125M, TP=2 + SP. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NO_APPEND=1
START=$SECONDS
tp2() {  # env... : one TP=2 + SP GPT-1.3B forward+backward run
  env TP=2 SP=1 MB=8 STEPS=${STEPS:-10} "$@" timeout ${T_RUN:-120} python3 -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/gpt.py 2>&1 | tee -a $OUT/gpt.log | grep RESULT
  echo "  ($* done at $((SECONDS - START)) s)"
}
if [ -z "$SKIP_GPT" ]; then
  # first: does a GEMM beside a real NCCL collective overlap, and with which SM margin (tpframe/comm/margin.py)?
  NO_APPEND=1 timeout 120 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/overlap.py 2>&1 \
    | tee $OUT/overlap_nccl.md | grep -E "^\|"
  tp2 ASYNC_TP=0
  tp2 ASYNC_TP=0 TP_OVERLAP=1 SM_MARGIN=0  # comm.overlap_backward=true, GEMMs on every SM
  tp2 ASYNC_TP=0 TP_OVERLAP=1  # ... with the default SM margin (16)
  tp2 ASYNC_TP=ring SM_MARGIN=0  # tpframe/layers/async_tp.py: NCCL send/receive pipelined under the GEMM blocks
  tp2 ASYNC_TP=ring  # ... with the default SM margin (16)
  tp2 ASYNC_TP=ring SM_MARGIN=32
  tp2 ASYNC_TP=symm_mem  # torch's fused symm_mem ops
  tp2 COMPILE=1
fi
if [ -n "$PROFILE_ASYNC" ]; then  # where the async-TP step's time goes, against the plain step's
  tp2 ASYNC_TP=ring STEPS=3 PROFILE=$OUT/prof_async.txt
  tp2 ASYNC_TP=0 STEPS=3 PROFILE=$OUT/prof_plain.txt
fi
if [ -n "$IDLE" ]; then  # how long the GPU idles in a step: the most a training CUDA graph could save
  tp2 STEPS=3 PROFILE=$OUT/prof_13b_tp2.txt
  tp2 STEPS=3 LAYERS=12 HIDDEN=768 HEADS=12 SEQ=1024 MB=16 PROFILE=$OUT/prof_125m_tp2.txt
  grep -h "GPU timeline" $OUT/prof_*.txt; rm -f $OUT/*.json  # the traces are large
fi
timeout ${T_STEP:-150} python3 benchmarks/pipeline.py layouts=tp-sp mb=8 gbs=8 steps=8 warmup=3 row_timeout=140 append=0 fwdbwd=1 \
  > $OUT/train_step.log 2>&1; echo "train step rc=$? at $((SECONDS - START)) s"; grep -E "^\| " $OUT/train_step.log
left=$(( ${BUDGET_S:-530} - (SECONDS - START) ))
timeout $left python3 benchmarks/pipeline.py layouts=${PP_LAYOUTS:-pp-1f1b,pp-interleaved,pp-zb_h1,pp-afab,tp-sp,dp} \
  steps=5 warmup=2 row_timeout=75 > $OUT/pipeline.log 2>&1
echo "pipeline rc=$? at $((SECONDS - START)) s"; grep -E "^\| |Bubble|bubble" $OUT/pipeline.log | head -20
rm -f $OUT/*.json  # profiler traces: too large to bring back
cp benchmarks/RESULTS.md $OUT/RESULTS.md
