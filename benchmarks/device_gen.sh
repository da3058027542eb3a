#!/bin/bash
# One device call on nvidia-h200-x2 (run from the repo root): the Lamport and generation GPU tests, the bf16
# all-reduce benchmark up to 1 MiB (Lamport column; writes the thresholds the decode benchmark then uses),
# the decode-attention kernel against SDPA, the decode benchmark at TP=2 with compiled blocks (NCCL + graph vs
# symm + graph: issue 11's target), then with eager blocks and transformers' rows, and NCCL on symmetric windows if
# time is left. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
set -o pipefail
START=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version())"
} > $OUT/env.txt 2>&1
for t in tests/test_lamport_gpu.py tests/test_generation_gpu.py; do
  timeout ${T_TESTS:-55} python3 -m pytest -q $t -p no:cacheprovider -rs --durations=5 2>&1 | tee -a $OUT/gpu_tests.log | tail -12
  echo "$t rc=$? at $((SECONDS - START)) s"
done
timeout ${T_COMM:-35} python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/comm.py --ops all_reduce --dtypes bf16 \
  --max-mib 1 --scale 0.5 > $OUT/comm.log 2>&1
echo "comm rc=$? at $((SECONDS - START)) s"; grep -E "^- (eager|graph)" $OUT/comm.log
timeout 40 python3 benchmarks/decode_attention.py > $OUT/decode_attention.log 2>&1
echo "decode attention rc=$? at $((SECONDS - START)) s"; grep -E "^\| " $OUT/decode_attention.log
# issue 11's target first: NCCL + graph vs symm + graph at TP=2 batch 1, the blocks compiled (~90 s of compilation)
timeout ${T_TARGET:-220} python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/decode.py --no-tp1 --hf "" --batches 1,8 \
  --modes nccl-graph,symm-graph --reps 3 --compile ${COMPILE_MODE:-max-autotune-no-cudagraphs} > $OUT/decode_compiled.log 2>&1
echo "decode compiled rc=$? at $((SECONDS - START)) s"; grep -E "^TP=|^\| |^- " $OUT/decode_compiled.log | tail -12
left=$(( ${BUDGET_S:-560} - (SECONDS - START) ))
if [ $left -gt 60 ]; then  # then the eager-block rows with transformers beside them, in what time is left
  timeout $left python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/decode.py --hf eager --hf-reps 2 \
    --hf-tp ${HF_TP:-eager} > $OUT/decode.log 2>&1
  echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^TP=|^\| |^- " $OUT/decode.log | tail -30
fi
if [ $((SECONDS - START)) -lt ${WINDOW_IF_BEFORE:-200} ]; then
  timeout 20 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/comm.py --nccl-window --max-mib 1 --scale 0.5 \
    > $OUT/window.log 2>&1; echo "window rc=$? at $((SECONDS - START)) s"; grep -E "^\| [0-9]|stopped" $OUT/window.log
fi
cp benchmarks/RESULTS.md tpframe/comm/symm/thresholds.json $OUT/ 2>/dev/null
