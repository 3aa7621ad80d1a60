#!/usr/bin/env bash
# TensorFlow/oneDNN threading settings on the whole SimCLR step (BUILD_NOTES.md, Performance):
# each setting runs `python -m tfmp.bench` (batch 64, bf16 and float32) in 2 interleaved rounds.
#     bash experiments/benchmarks/env_sweep.sh > runs/env_sweep.txt
# Output lines: round|setting|bench JSON.
export TF_CPP_MIN_LOG_LEVEL=2
for round in 1 2; do
  for cfg in "BASE=1" "TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD=true" "TF_NUM_INTEROP_THREADS=1" "TF_ONEDNN_ENABLE_FAST_CONV=1" "TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD=true TF_NUM_INTEROP_THREADS=1"; do
    for p in mixed_bfloat16 float32; do
      out=$(env $cfg python -m tfmp.bench --batch=64 --steps=5 --repeats=2 --warmup=2 --precision=$p 2>/dev/null | tail -1)
      echo "$round|$cfg|$out"
    done
  done
done
