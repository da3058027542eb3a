#!/bin/bash
# One device call on nvidia-h200-x2 (run from the repo root): the performance paths' GPU tests, host overhead of
# the eager collectives, and one profiled GPT-1.3B step at TP=1 and at TP=2 + SP (eager, fused kernels on), with
# ablations (fused kernels off; async TP on). Logs under $OUT (at most 8 files come back).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NO_APPEND=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())"
run1() {  # gpu, log, env... : one single-GPU GPT run in the background
  local gpu=$1 log=$2; shift 2
  env CUDA_VISIBLE_DEVICES=$gpu TP=1 "$@" timeout ${T_RUN:-100} python3 -m torch.distributed.run --nproc-per-node 1 \
    --master-port $((29600 + gpu)) benchmarks/gpt.py >> $OUT/$log 2>&1
}
run2() {  # log, env... : one TP=2 GPT run
  local log=$1; shift
  env TP=2 "$@" timeout ${T_RUN:-100} python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpt.py >> $OUT/$log 2>&1
}
# single-GPU: TP=1 with the fused kernels (profiled) on GPU 0 and without them on GPU 1, then the kernel tests
run1 0 runs.log PROFILE=$OUT/prof_tp1.txt & run1 1 runs_nofused.log FUSED=0 & wait
timeout ${T_TESTS:-120} python3 -m pytest -q -x tests/test_perf_gpu.py -k "rotary or cross_entropy" \
  -p no:cacheprovider -rs 2>&1 | tee $OUT/perf_tests.log | tail -5
timeout ${T_TESTS2:-200} python3 -m pytest -q tests/test_perf_gpu.py -k "async or compiled" -p no:cacheprovider -rs 2>&1 \
  | tee -a $OUT/perf_tests.log | tail -8
timeout 60 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/host_overhead.py --iters 300 --rounds 10 \
  > $OUT/host_overhead.log 2>&1; tail -14 $OUT/host_overhead.log
run2 runs.log SP=1 PROFILE=$OUT/prof_tp2.txt
run2 runs.log SP=1 ASYNC_TP=ring
run2 runs.log SP=1 ASYNC_TP=symm_mem
grep -h RESULT $OUT/runs*.log
