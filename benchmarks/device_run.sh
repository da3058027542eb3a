#!/bin/bash
# One device call (run from the repo root):  environment, GPU tests, then the communication benchmark. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T_TESTS=${T_TESTS:-200}; T_BENCH=${T_BENCH:-190}; BENCH_ARGS=${BENCH_ARGS:-}
{ nvidia-smi topo -m; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"; } > $OUT/env.txt 2>&1
timeout $T_TESTS python3 -m pytest -q tests/test_symm_gpu.py -p no:cacheprovider -rs 2>&1 | tee $OUT/gpu_tests.log | tail -40
timeout $T_BENCH python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/comm.py --results benchmarks/RESULTS.md $BENCH_ARGS > $OUT/bench.log 2>&1
rc=$?; echo "bench rc=$rc"; tail -60 $OUT/bench.log
if [ $rc != 0 ]; then  # once more with Triton's own launcher, in case the minimal one is what failed
  TPFRAME_SYMM_TRITON_LAUNCHER=1 timeout $T_BENCH python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/comm.py \
    --results benchmarks/RESULTS.md $BENCH_ARGS > $OUT/bench_triton_launcher.log 2>&1; echo "retry rc=$?"
fi
cp benchmarks/RESULTS.md tpframe/comm/symm/thresholds.json $OUT/ 2>/dev/null
