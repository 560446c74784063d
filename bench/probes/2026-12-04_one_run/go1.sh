#!/bin/bash
# device call 1: the bf16 benchmark, every shape and M, with the stage breakdown (one run, one set
# of ceilings), results under $OUT/bf16 (the CSV is written row by row, so a cut-off run keeps them)
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 545 python -m tmoe bench --dtype bf16 --stages --rep-ms 40 --out $OUT/bf16 --commit "$1" 2>&1 \
    | grep -v Warning | tee $OUT/bench_bf16.log | grep -E "^#|tmoe:|stopped|Error" | tail -40
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
