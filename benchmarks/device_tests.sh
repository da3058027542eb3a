#!/bin/bash
# One device call (repo root; nvidia-h200-x2 runs the 2-GPU tests too): every GPU test of the suite (`-m gpu`,
# every file that has one), one pytest per file so a hang costs one file's time limit; stops starting files once
# BUDGET_S seconds are spent. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
START=$SECONDS; BUDGET_S=${BUDGET_S:-520}
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
} > $OUT/env.txt 2>&1; cat $OUT/env.txt
FILES=${FILES:-$(grep -l "pytest.mark.gpu" tests/test_*.py | xargs -n1 basename | sed "s/\.py$//" | tr "\n" " ")}  # every file with a GPU test
for f in $FILES; do
  left=$((BUDGET_S - (SECONDS - START)))
  if [ $left -lt 20 ]; then echo "$f: not run (budget spent)" | tee -a $OUT/gpu_tests.log; continue; fi
  timeout $left python3 -m pytest -q tests/$f.py -m gpu -p no:cacheprovider -rs --durations=3 > $OUT/$f.log 2>&1
  rc=$?; echo "$f rc=$rc at $((SECONDS - START)) s: $(grep -E '(passed|failed|skipped|error)' $OUT/$f.log | tail -1)" \
    | tee -a $OUT/gpu_tests.log
  [ $rc != 0 ] && [ $rc != 5 ] && grep -E "^(FAILED|ERROR)|Error" $OUT/$f.log | head -8
done
