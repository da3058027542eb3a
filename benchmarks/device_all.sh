#!/bin/bash
# One device call on nvidia-h200-x2 (repo root; carry .peers): GPU tests, the GPT-125M TP=2 run,
# then tpframe vs Megatron-Core throughput. Logs and results under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
set -o pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/env.txt
timeout ${T_TESTS:-240} python3 -m pytest -q tests -m gpu -p no:cacheprovider -rs 2>&1 | tee $OUT/gpu_tests.log | tail -15
rm -rf /tmp/run125m
timeout ${T_RUN:-200} python3 -m torch.distributed.run --nproc-per-node 2 train.py --config configs/gpt_125m.yaml \
    train.run_dir=/tmp/run125m checkpoint.interval=100 checkpoint.async_save=true > $OUT/run125m.log 2>&1
echo "gpt_125m rc=$?"; grep -E "^step|eval|done|tpframe:" $OUT/run125m.log | tail -25
cp /tmp/run125m/metrics.jsonl $OUT/metrics125m.jsonl
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/megatron_core-*.whl > /dev/null 2>&1
bench() {  # name, env...
  env "${@:2}" timeout 120 python3 -m torch.distributed.run --nproc-per-node 2 $1 2>&1 | grep RESULT | tee -a $OUT/bench_gpt.log
}
S125="LAYERS=12 HIDDEN=768 HEADS=12 SEQ=1024 MB=16 STEPS=20"
S13="LAYERS=24 HIDDEN=2048 HEADS=16 SEQ=2048 MB=4 STEPS=10"
for shape in "$S125" "$S13"; do
  bench benchmarks/gpt.py TP=2 SP=0 COMM=nccl $shape
  bench benchmarks/gpt.py TP=2 SP=0 COMM=auto $shape
  bench benchmarks/gpt.py TP=2 SP=1 COMM=auto $shape
  bench .peers/bench_mcore_gpt.py PYTHONPATH=/tmp/site TP=2 SP=0 $shape
done
cp benchmarks/RESULTS.md $OUT/RESULTS.md
