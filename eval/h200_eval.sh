#!/usr/bin/env bash
# The SmolLM2-135M report on an H200: original (SiLU) vs bare ReLU swap vs fine-tuned, side by side:
# accuracy on the local tasks (eval/tasks/), perplexity + sparsity profile on held-out text, and speed
# (prefill grid and decode; dense vs twell vs auto on the same weights, same run).
#
#   here (has network to PyPI):  bash eval/h200_eval.sh fetch        # wheels into .whl/ (~10 MiB)
#   on the H200 (carry .whl):    bash eval/h200_eval.sh run ORIG RELU FT [OUT]
#       ORIG: the SmolLM2 .gguf (or a SiLU model folder); RELU: `sparsify convert` output; FT: finetune output.
#       OUT defaults to eval/results/eval-smollm2-h200. A smaller speed grid: SPEED_BATCHES=1,16 SPEED_SEQS=2048
#       DECODE_BATCHES=1,16 (comma lists; defaults 1,8,32,64 / 512,2048 / 1,16,64).
#
# The H200 image (torch 2.11, transformers 5.17, triton 3.6) already has pandas, pyarrow, fsspec, xxhash,
# sacrebleu, lxml, tabulate, portalocker, requests, pyyaml, matplotlib. Missing there, carried as wheels:
#   lm_eval==0.4.13 (9 MiB), datasets==5.2.0, dill==0.4.1, multiprocess==0.70.19, more_itertools, fsspec==2026.9.0
#   (datasets' upper bound), gguf==0.19.0 (only to load ORIG from the .gguf).
# lm-eval's other declared needs (evaluate, rouge-score, scikit-learn, sqlitedict, word2number,
# pytablewriter) are not imported by the multiple-choice / loglikelihood_rolling tasks sparsify runs.
# If lm_eval still fails to import there (e.g. the image's pyarrow is older than datasets' >= 24), the run
# falls back to --tasks none; then measure accuracy on the CPU box and merge:
#   sparsify eval orig=ORIG relu=RELU ft=FT --tasks eval/tasks/ --out eval/results/eval-smollm2-cpu-acc
#   python -m sparsify.evaluation.report eval/results/eval-smollm2-cpu-acc eval/results/eval-smollm2-h200 \
#       --out eval/results/eval-smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

fetch() {
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 more_itertools fsspec==2026.9.0 gguf==0.19.0
  du -sh .whl
}

run() {
  local orig=$1 relu=$2 ft=$3 out=${4:-eval/results/eval-smollm2-h200}
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  local tasks=eval/tasks/
  if ! "$PY" -c "import lm_eval.evaluator, datasets" 2>/tmp/lm_eval_import.log; then
    echo "lm_eval/datasets do not import here ($(tail -1 /tmp/lm_eval_import.log)): accuracy skipped;" \
         "measure it on the CPU box and merge with python -m sparsify.evaluation.report (see the header)."
    tasks=none
  fi
  # the GPU tests of the eval stage first: every backend measured, ratios formed, auto restored
  "$PY" -m pytest -q -m gpu tests/evaluation/test_evaluate.py
  # held-out text (not in the fine-tuning data) for perplexity, the sparsity profile and speed inputs
  "$PY" -m sparsify eval "orig=$orig" "relu=$relu" "ft=$ft" --tasks "$tasks" \
    --text sparsify/corpus/python-howto-heldout.txt --text-tokens 16384 --speed \
    --speed-batches "${SPEED_BATCHES:-1,8,32,64}" --speed-seqs "${SPEED_SEQS:-512,2048}" \
    --decode-batches "${DECODE_BATCHES:-1,16,64}" --batch-size 32 --out "$out" --overwrite
}

case "${1:-}" in
  fetch) fetch ;;
  run) shift; [ $# -ge 3 ] || { echo "usage: $0 run ORIG RELU FT [OUT]" >&2; exit 2; }; run "$@" ;;
  *) echo "usage: $0 fetch | run ORIG RELU FT [OUT]" >&2; exit 2 ;;
esac
