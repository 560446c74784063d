#!/bin/bash
# device call 3: the GPU tests at the benchmarked tree
export PYTHONPATH=$PWD
(timeout 300 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -6) > $OUT/gpu_tests.log 2>&1; cat $OUT/gpu_tests.log
