#!/bin/bash
# lm-evaluation-harness on max serve on maxkv (its local-completions model, which scores
# through `echo` + `logprobs`), then on transformers (its hf model), the same task:
# the perplexity of the GPL-3 text's sections (a task written from a local text: the
# harness runs offline). Needs lm-eval[api] (not a maxkv dependency) and SmolLM2
# exported once (python benchmarks/serve.py exports it; or give MODEL=DIR).
#
#   bash benchmarks/lm_eval/run.sh        # results in $OUT (default /tmp/maxkv_lm_eval)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-$HOME/.cache/maxkv/models/smollm2-135m-hf}
OUT=${OUT:-/tmp/maxkv_lm_eval}
LM_EVAL=${LM_EVAL:-lm_eval}
PORT=${PORT:-8765}
mkdir -p "$OUT/tasks"
python "$HERE/make_task.py" "$OUT/tasks"
ARCH=$(python -c "import maxkv.pipelines as p; print(p.CUSTOM_ARCHITECTURES)")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_SERVE_DISABLE_TELEMETRY=1
max serve --custom-architectures "$ARCH" --model-path "$MODEL" --devices cpu \
  --quantization-encoding float32 --max-batch-size 4 --max-length 2048 \
  --kv-cache-page-size 16 --host 127.0.0.1 --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 900); do curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break; sleep 2; done
"$LM_EVAL" --model local-completions --tasks gpl3_perplexity --include_path "$OUT/tasks" \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL,tokenizer_backend=huggingface,tokenized_requests=True,max_length=1024,num_concurrent=2" \
  --output_path "$OUT/maxkv"
kill $SERVER
"$LM_EVAL" --model hf --model_args "pretrained=$MODEL,dtype=float32,max_length=1024" \
  --device cpu --batch_size 1 --tasks gpl3_perplexity --include_path "$OUT/tasks" \
  --output_path "$OUT/transformers"
