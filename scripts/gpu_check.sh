#!/usr/bin/env bash
# One device lease's prepared run (see scripts/gpu_check.py): the tiny-model engine suite and the
# CUDA tests on the GPU, then the speed check on random-weight targets. The lease's machine has its
# own torch; transformers and its hub client travel as wheels in .whl/ (pinned versions):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2 accelerate==1.10.1
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
EAGLESPEC_TEST_DEVICE=cuda timeout "${TEST_S:-240}" python3 -m pytest -q -n 8 -p no:cacheprovider -rfE \
  tests/test_cuda.py tests/test_engine.py 2>&1 | tee "$OUT/pytest.log" | tail -40
timeout "${SPEED_S:-260}" python3 scripts/gpu_check.py --out "$OUT" --budget-s "${BUDGET_S:-200}" 2>&1 | tail -30
