#!/bin/bash
# The GPU test suite and the measurements behind README's and RESULTS.md's numbers, as named suites, one device call
# each (repo root, nvidia-h200-x2; the peers' scripts and Megatron-Core's wheel in .peers, carried):
#   bash benchmarks/device.sh SUITE [SUITE ...]        logs under $OUT, RESULTS.md and thresholds.json copied there
#   tests      every GPU test, one pytest per file (FILES="test_a test_b": some), until BUDGET_S seconds are spent
#   headline   README's Performance table: GPT-125M trained at TP=2 + SP, then tpframe vs Megatron-Core at TP=2
#   gpt        benchmarks/gpt.py --compare --shapes $SHAPES (default 1.3b): tpframe vs the torch-native peers
#   kernels    GPT-1.3B and GPT-125M at TP=1 with tpframe's Triton kernels (FUSED=1) and with torch's ops (FUSED=0)
#   async_tp   GPT-1.3B TP=2 + SP, async TP by copy engines vs the plain path (eager, CUDA graph, compiled + graph)
#   pipeline   the full train step against forward+backward (TP=1), then PP schedules beside TP=2 + SP and DP=2
#   comm       the symm kernels' GPU tests, then every collective (tables, and the thresholds `auto` uses)
#   decode     generation's GPU tests, bf16 all-reduce thresholds to 1 MiB, then decode.py (README's per-token numbers)
#   dp         the training GPU tests, then benchmarks/data_parallel.py (ROWS, PHASES, ... pass through), then CKPT=1
#   snapshot   benchmarks/snapshot.py on GPT-125M: a disk checkpoint vs a host-memory snapshot every step (GPUS=2)
#   fp8        (1 GPU) the float8 GPU tests, then benchmarks/fp8_loss.py: GPT-1.3B 1,000 steps per recipe beside bf16
#   fp8_peer   benchmarks/gpt.py --compare --fp8 --shapes ${SHAPES:-7b} --tp ${TP:-4} --layers 8: each recipe beside
#              bf16 and torchao's (its wheel in .peers): at real TP on as many GPUs, the comm-free rank on one
#   long_context  (nvidia-h200-x4) CP's GPU tests, then benchmarks/long_context.py --compare --shapes $SHAPES
#              (default llama3-8b) --seqs $SEQS (default 131072): tpframe's CP modes vs torch's context_parallel
#              (GPUS=2 on nvidia-h200-x2: the CP=2 table; LAYERS=N: N of each shape's layers)
#   long_context_train  (nvidia-h200-x4) benchmarks/long_context.py --train: train.py's peak vs the memory estimate
# NVLink multicast is forbidden on these machines: every program started here inherits the three exports below.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OUT=${OUT:-/tmp/device}
set -o pipefail
START=$SECONDS BUDGET_S=${BUDGET_S:-560}
left() { echo $((BUDGET_S - (SECONDS - START))); }
at() { echo "  ($* at $((SECONDS - START)) s)"; }
RUN="python3 -m torch.distributed.run" PYTEST="python3 -m pytest -q -p no:cacheprovider -rs"
G125="LAYERS=12 HIDDEN=768 HEADS=12 SEQ=1024 MB=16 STEPS=20"
G13="LAYERS=24 HIDDEN=2048 HEADS=16 SEQ=2048"

suite_tests() {
  for f in ${FILES:-$(grep -l "pytest.mark.gpu" tests/test_*.py | xargs -n1 basename | sed "s/\.py$//")}; do
    [ "$(left)" -lt 20 ] && { echo "$f: not run (budget spent)"; continue; }
    timeout "$(left)" $PYTEST tests/$f.py -m gpu --durations=3 > $OUT/$f.log 2>&1
    rc=$?; echo "$f rc=$rc at $((SECONDS - START)) s: $(grep -E '(passed|failed|skipped|error)' $OUT/$f.log | tail -1)"
    [ $rc != 0 ] && [ $rc != 5 ] && grep -E "^(FAILED|ERROR)|Error" $OUT/$f.log | head -8
  done | tee -a $OUT/gpu_tests.log
}

suite_headline() {
  rm -rf /tmp/run125m
  timeout 200 $RUN --nproc-per-node 2 train.py --config configs/gpt_125m.yaml train.run_dir=/tmp/run125m \
    checkpoint.interval=100 checkpoint.async_save=true > $OUT/run125m.log 2>&1
  echo "gpt_125m rc=$?"; grep -E "^step|eval|done|tpframe:" $OUT/run125m.log | tail -25
  cp /tmp/run125m/metrics.jsonl $OUT/metrics125m.jsonl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/megatron_core-*.whl > /dev/null 2>&1
  for shape in "$G125" "$G13 MB=4 STEPS=10"; do
    for run in "COMM=nccl SP=0" "COMM=auto SP=0" "COMM=auto SP=1"; do
      env TP=2 $shape $run timeout 120 $RUN --nproc-per-node 2 benchmarks/gpt.py 2>&1 | grep RESULT
    done
    env TP=2 SP=0 $shape PYTHONPATH=/tmp/site timeout 120 $RUN --nproc-per-node 2 .peers/bench_mcore_gpt.py 2>&1 \
      | grep RESULT
  done | tee -a $OUT/headline.log
}

suite_gpt() {
  python3 benchmarks/gpt.py --compare --shapes ${SHAPES:-1.3b} --budget-s $(($(left) - 40)) --logs $OUT 2>&1 \
    | tee $OUT/gpt.log
}

suite_kernels() {  # two single-GPU runs at a time, one per GPU
  for shape in "$G13 MB=8 STEPS=10" "$G125"; do
    for gpu in 0 1; do
      env CUDA_VISIBLE_DEVICES=$gpu TP=1 FUSED=$((1 - gpu)) $shape timeout 150 \
        $RUN --nproc-per-node 1 --master-port $((29600 + gpu)) benchmarks/gpt.py 2>&1 | grep RESULT &
    done
    wait
  done | tee -a $OUT/kernels.log
}

suite_async_tp() {
  timeout 60 $PYTEST tests/test_perf_gpu.py -k async_tp_layers_match 2>&1 | tail -2
  timeout 120 $PYTEST tests/test_gpu_training.py -k copy_engine_async_tp 2>&1 | tail -2
  for run in "ASYNC_TP=0" "ASYNC_TP=copy_engine" "ASYNC_TP=0 GRAPH=1" "ASYNC_TP=copy_engine GRAPH=1" \
    "COMPILE=1 GRAPH=1 ASYNC_TP=0" "COMPILE=1 GRAPH=1 ASYNC_TP=copy_engine"; do
    env TP=2 SP=1 MB=8 $G13 $run timeout 150 $RUN --nproc-per-node 2 benchmarks/gpt.py 2>&1 | tee -a $OUT/gpt.log \
      | grep -E "RESULT|rror" | cut -c1-400
    at "$run"
  done
  env TP=2 SP=1 MB=8 STEPS=10 $G13 COMPILE=1 ASYNC_TP=1 timeout 150 $RUN --nproc-per-node 2 \
    .peers/bench_dtensor_gpt.py 2>&1 | tee -a $OUT/peer.log | grep RESULT
}

suite_pipeline() {
  timeout 150 python3 benchmarks/pipeline.py nproc=1 layouts=tp-sp mb=8 gbs=8 steps=8 warmup=3 fwdbwd=1 \
    row_timeout=140 > $OUT/train_step.log 2>&1
  at "train step rc=$?"; grep -E "^\| " $OUT/train_step.log
  timeout "$(left)" python3 benchmarks/pipeline.py steps=5 warmup=2 row_timeout=75 \
    layouts=${PP_LAYOUTS:-pp-1f1b,pp-interleaved,pp-zb_h1,pp-afab,tp-sp,dp} > $OUT/pipeline.log 2>&1
  at "pipeline rc=$?"; grep -E "^\| |ubble" $OUT/pipeline.log | head -20
}

suite_comm() {
  timeout 200 $PYTEST tests/test_symm_gpu.py 2>&1 | tee $OUT/symm_tests.log | tail -5
  timeout 190 $RUN --nproc-per-node 2 benchmarks/comm.py $COMM_ARGS > $OUT/comm.log 2>&1
  at "comm rc=$?"; tail -60 $OUT/comm.log
}

suite_decode() {
  timeout 110 $PYTEST tests/test_lamport_gpu.py tests/test_generation_gpu.py 2>&1 | tee $OUT/decode_tests.log | tail -8
  timeout 35 $RUN --nproc-per-node 2 benchmarks/comm.py --ops all_reduce --dtypes bf16 --max-mib 1 --scale 0.5 \
    > $OUT/comm.log 2>&1  # the Lamport thresholds the decode rows use
  at "comm rc=$?"; grep -E "^- (eager|graph)" $OUT/comm.log
  timeout 220 $RUN --nproc-per-node 2 benchmarks/decode.py --no-tp1 --hf "" --batches 1,8 --reps 3 \
    --modes nccl-graph,symm-graph --compile max-autotune-no-cudagraphs > $OUT/decode_compiled.log 2>&1
  at "decode, compiled blocks rc=$?"; grep -E "^TP=|^\| |^- " $OUT/decode_compiled.log | tail -12
  [ "$(left)" -gt 60 ] || return 0
  timeout "$(left)" $RUN --nproc-per-node 2 benchmarks/decode.py --hf eager --hf-reps 2 --hf-tp eager \
    > $OUT/decode.log 2>&1
  at "decode rc=$?"; grep -E "^TP=|^\| |^- " $OUT/decode.log | tail -30
}

suite_dp() {
  [ -n "$SKIP_TESTS" ] || timeout 200 $PYTEST tests/test_gpu_training.py 2>&1 | tee $OUT/dp_tests.log | tail -8
  timeout 330 python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp.log | grep -v "^W1" | tail -20
  [ "$(left)" -gt 60 ] || return 0
  CKPT=1 timeout "$(left)" python3 benchmarks/data_parallel.py 2>&1 | tee $OUT/dp_ckpt.log | grep -v "^W1" | tail -20
}

suite_snapshot() {
  timeout "$(left)" python3 benchmarks/snapshot.py --config configs/gpt_125m.yaml --gpus ${GPUS:-2} 2>&1 \
    | tee $OUT/snapshot.log | tail -6
}

suite_fp8() {
  timeout 240 $PYTEST tests/test_fp8.py -m gpu 2>&1 | tee $OUT/fp8_tests.log | tail -3
  timeout "$(left)" python3 benchmarks/fp8_loss.py --config configs/gpt_1.3b.yaml --steps 1000 --out $OUT/fp8_runs \
    --set parallel.tp=1 train.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=4 optim.warmup_steps=100 \
    2>&1 | tail -6
}

suite_fp8_peer() {
  python3 benchmarks/gpt.py --compare --fp8 --shapes ${SHAPES:-7b} --tp ${TP:-4} --layers 8 \
    --budget-s $(($(left) - 30)) --logs $OUT --results $OUT/fp8_peer.md 2>&1 | tee $OUT/fp8_peer.log | grep -v "^|"
  cat $OUT/fp8_peer.md
}

suite_long_context() {
  timeout 200 $PYTEST tests/test_context_parallel.py -m gpu 2>&1 | tee $OUT/cp_tests.log | tail -3
  python3 benchmarks/long_context.py --compare --gpus ${GPUS:-4} ${LAYERS:+--layers $LAYERS} \
    --shapes ${SHAPES:-llama3-8b} --seqs ${SEQS:-131072} --budget-s $(($(left) - 30)) --logs $OUT 2>&1 \
    | tee $OUT/long_context.log
}

suite_long_context_train() {
  timeout "$(left)" python3 benchmarks/long_context.py --train --shapes ${SHAPES:-llama3-8b} --seqs ${SEQS:-131072} \
    --job-timeout-s $(($(left) / 2 - 10)) --logs $OUT 2>&1 | tee $OUT/long_context_train.log
}

[ $# -gt 0 ] || { sed -n 2,22p "$0"; exit 2; }
for suite in "$@"; do
  declare -F suite_$suite > /dev/null || { echo "benchmarks/device.sh: no suite '$suite'; see: sed -n 2,22p $0"; exit 2; }
done
mkdir -p $OUT
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', \
torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
for suite in "$@"; do echo "== $suite"; suite_$suite; at "$suite done"; done
cp benchmarks/RESULTS.md tpframe/comm/symm/thresholds.json $OUT/ 2>/dev/null
