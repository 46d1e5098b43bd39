#!/usr/bin/env bash
# The GPU study on a lent machine that has no MAX and no network, and whose
# time is short: everything is compiled here, nothing there.
#
# Here (maxkv's venv active, pip reaching PyPI; about 15 minutes on 2 cores):
#   bash benchmarks/gpu_machine.sh payload
# builds .gpu/a, .gpu/b and .gpu/c, each under one call's 64 MiB (.gpu/ must be ignored,
# .git/info/exclude):
#   a, b: MAX 26.7's cp312 wheels unpacked, less what a study does not use
#         (language server, REPL, LLDB, NIXL's plugins, NVSHMEM), plus the
#         Python packages MAX imports that the machine lacks and
#         transformers 5.12 (MAX's pin), as xz tarballs; maxkv's compiled
#         Mojo package;
#   c:    the mojo and lld binaries, and every graph of the study's attention
#         and end_to_end parts compiled for the GPU (`gpu_study.py --device
#         virtual --target cuda:sm_90a --parts export`, ~1 MB), which the
#         machine loads instead of compiling.
# There, one call per part while the machine is warm (it goes back after 30 s
# idle, /tmp with it):
#   bash benchmarks/gpu_machine.sh stash a        (carry .gpu/a)
#   bash benchmarks/gpu_machine.sh stash b        (carry .gpu/b)
#   bash benchmarks/gpu_machine.sh stash c && bash benchmarks/gpu_machine.sh study
#   bash benchmarks/gpu_machine.sh families       (if device time is left)
# `study` unpacks MAX into /tmp/site, checks that a graph runs on the GPU, then
# runs, each under a time limit (all under STUDY_S): the attention part
# (precompiled graphs), `pytest -m gpu` (every test, eight at a time: each
# compiles its graphs there), then the end_to_end part at batch 1 and 32 on
# SmolLM2's shape and one family's (precompiled graphs), with the results in
# $OUT/gpu_<kind>.json and every log in $OUT/study.log.
# `families` runs end_to_end on the families' shapes at batch 1, 8, 32 and 64
# (their graphs precompiled where the payload exported them).
#
# A graph's artifact is keyed by its body, not by where its kernels lie: after a
# change to maxkv's Mojo sources alone, `bash benchmarks/gpu_machine.sh kernels`
# rebuilds just .gpu/b/kernels.tar (the package maxkv looks for by its digest).
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
FAMILY_SHAPES=qwen2.5-0.5b,qwen3-0.6b,gemma-3-1b
pay=/tmp/maxkv_payload
site=/tmp/site

setup_env() {
    export PYTHONPATH="$site:$here/python:$here/benchmarks"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
    export MAXKV_CACHE_DIR=/tmp/maxkv_cache
    export OUT="${OUT:-/tmp/out}"
    mkdir -p "$OUT"
}

unpack() {
    mkdir -p "$site"
    if [ ! -f "$site/.core" ] && [ -f "$pay/core.tar.xz.1" ]; then
        cat "$pay"/core.tar.xz.* | xz -d -T0 | tar -x -C "$site" && touch "$site/.core"
    fi
    if [ ! -f "$site/.tf" ] && [ -f "$pay/tf.tar.xz" ]; then
        xz -d -T0 <"$pay/tf.tar.xz" | tar -x -C "$site" && touch "$site/.tf"
    fi
    if [ ! -e "$site/modular/bin/mojo" ]; then
        # MAX finds its kernel packages from the folder holding bin/mojo; until
        # part c brings the compiler, a stand-in marks the folder.
        printf '#!/bin/sh\necho "mojo arrives with part c" >&2\nexit 1\n' >"$site/modular/bin/mojo"
        chmod +x "$site/modular/bin/mojo"
    fi
    if [ -f "$pay/kernels.tar" ]; then  # maxkv's compiled Mojo package (no mojo needed)
        mkdir -p "$MAXKV_CACHE_DIR" && tar -x -C "$MAXKV_CACHE_DIR" -f "$pay/kernels.tar"
    fi
    if [ ! -f "$site/.bins" ] && [ -f "$pay/bins.tar.xz" ]; then
        xz -d -T0 <"$pay/bins.tar.xz" | tar -x -C "$site/modular/bin" && touch "$site/.bins"
    fi
    if [ ! -f /tmp/mefs/manifest.json ] && [ -f "$pay/mefs.tar.xz" ]; then
        mkdir -p /tmp/mefs && xz -d -T0 <"$pay/mefs.tar.xz" | tar -x -C /tmp/mefs
    fi
    ls -a "$site" | grep '^\.[a-z]' | tr '\n' ' '
    echo
}

kernels_tar() {  # maxkv's compiled Mojo package, as .gpu/b/kernels.tar
    local built
    built=$(mktemp -d)
    MAXKV_CACHE_DIR="$built" python3 -c "from maxkv.kernels import kernels_path; kernels_path()"
    tar -C "$built" -cf "$here/.gpu/b/kernels.tar" --exclude='.staging*' .
    rm -rf "$built"
}

case "${1:-}" in
payload)
    set -e
    work=$(mktemp -d)
    py="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12"
    py="$py --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64"
    py="$py --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $work/whl"
    $py max==26.7.0 max-core==26.7.0 max-mojo-libs==26.7.0 mojo==1.2.0 mojo-compiler==1.2.0 \
        mojo-compiler-mojo-libs==1.2.0 msgspec==0.22.0 gguf==0.19.0 pydantic==2.14.4 \
        pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
        typing-inspection==0.4.5 python-dotenv==1.2.4 pyzmq==27.3.0 fastapi==0.141.1 \
        starlette==1.10.0 sse-starlette==2.1.3 uvicorn==0.54.0 opentelemetry-api==1.35.0 \
        opentelemetry-sdk==1.35.0 opentelemetry-exporter-otlp-proto-grpc==1.35.0 \
        opentelemetry-exporter-otlp-proto-http==1.35.0 opentelemetry-exporter-otlp-proto-common==1.35.0 \
        opentelemetry-exporter-prometheus==0.56b0 opentelemetry-proto==1.35.0 \
        opentelemetry-semantic-conventions==0.56b0 googleapis-common-protos==1.76.0 \
        openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 \
        truststore==0.10.5 importlib-metadata==8.7.1 jsonschema==4.26.0 \
        jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
        python-json-logger==4.2.0 taskgroup==0.2.2 exceptiongroup==1.3.2 \
        transformers==5.12.1 tokenizers==0.22.2
    mkdir -p "$work/site"
    for f in "$work"/whl/*.whl; do unzip -q -o "$f" -d "$work/site"; done
    for d in "$work"/site/*.data/platlib; do cp -a "$d/." "$work/site/"; rm -rf "$(dirname "$d")"; done
    m="$work/site/modular"
    rm -rf "$m"/bin/mojo-lsp-server "$m"/lib/mojo-repl-entry-point "$m"/bin/lldb-* \
        "$m"/bin/mojo-lldb "$m"/bin/llvm-symbolizer "$m"/lib/nixl "$m"/lib/libMojoJupyter.so \
        "$m"/lib/lldb-visualizers
    mkdir -p "$work/site/av"
    cp "$here/benchmarks/maxkv_bench/av_stub.py" "$work/site/av/__init__.py"
    rm -rf "$here/.gpu" && mkdir -p "$here/.gpu/a" "$here/.gpu/b" "$here/.gpu/c"
    tf="transformers transformers-5.12.1.dist-info tokenizers tokenizers-0.22.2.dist-info"
    (cd "$work/site" && tar -cf - $tf | xz -6 -T0 >"$here/.gpu/b/tf.tar.xz")
    (cd "$work/site/modular/bin" && tar -cf - mojo lld | xz -6 -T0 >"$here/.gpu/c/bins.tar.xz")
    (cd "$work/site" && rm -rf $tf modular/bin/mojo modular/bin/lld && tar -cf - . | xz -6 -T0) \
        | split -b 55000000 -d -a 1 - "$here/.gpu/core.tar.xz."
    if [ -e "$here/.gpu/core.tar.xz.2" ]; then
        echo "MAX's files no longer fit two parts: split them in three" >&2
        exit 1
    fi
    mv "$here/.gpu/core.tar.xz.0" "$here/.gpu/a/" && mv "$here/.gpu/core.tar.xz.1" "$here/.gpu/b/"
    kernels_tar
    # The study's graphs for an H100/H200 (sm_90a), compiled on virtual devices.
    (cd "$here/benchmarks" && python3 gpu_study.py --device virtual --target cuda:sm_90a \
        --parts export --shapes "smollm2,$FAMILY_SHAPES" --export-mefs "$work/mefs" \
        --json "$work/export.json")
    (cd "$work/mefs" && tar -cf - . | xz -6 -T0 >"$here/.gpu/c/mefs.tar.xz")
    rm -rf "$work"
    du -sh "$here"/.gpu/*
    ;;
kernels)
    set -e
    kernels_tar
    tar -tf "$here/.gpu/b/kernels.tar"
    ;;
stash)
    mkdir -p "$pay" && cp "$here/.gpu/$2"/* "$pay/" && ls -la "$pay"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    ;;
check)
    setup_env
    unpack
    python3 "$here/benchmarks/gpu_check.py" 2>&1 | tee "$OUT/check.log"
    ;;
study | families)
    # One call, smallest first, each step under its own cap and the whole under
    # STUDY_S (default 540 s), every result written under $OUT as it lands:
    # SmolLM2's 30-layer shape, then one family (both against MAX's pipeline),
    # `pytest -m gpu` (but the families'), decode attention, the families' gpu
    # tests; `families`: those tests, then the other families' shapes.
    setup_env
    unpack
    budget=${STUDY_S:-540}
    start=$SECONDS
    step() {  # step NAME CAP COMMAND...: runs while time is left
        local name=$1 cap=$2 left=$((budget - (SECONDS - start)))
        shift 2
        [ "$left" -lt 20 ] && { echo "$name: skipped, ${left} s left"; return; }
        [ "$cap" -gt "$left" ] && cap=$left
        echo "======== $name (cap $cap s)" >>"$OUT/study.log"
        timeout -k 10 "$cap" "$@" >>"$OUT/study.log" 2>&1
        echo "$name: rc $? at $((SECONDS - start)) s (cap $cap s)" | tee -a "$OUT/study.log"
    }
    step check 120 python3 "$here/benchmarks/gpu_check.py"
    grep -q "check passed" "$OUT/study.log" || { tail -n 30 "$OUT/study.log"; exit 1; }
    cd "$here/benchmarks"
    kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i 'h[0-9]00' | tr A-Z a-z)
    results="$OUT/gpu_${kind:-unknown}.json"
    # The artifacts' host code was compiled on this project's AMD machine; should
    # the machine's CPU refuse it (SIGILL), NO_MEFS=1 compiles there instead.
    mefs=()
    [ -f /tmp/mefs/manifest.json ] && [ -z "${NO_MEFS:-}" ] && mefs=(--precompiled-mefs /tmp/mefs)
    # MAX's generate() prefills at most 8192 tokens at once (64 prompts of 128).
    e2e=(python3 gpu_study.py --json "$results" --parts end_to_end "${mefs[@]}")
    shapes=(${FAMILY_SHAPES//,/ })
    # The tests compile each graph there (minutes each, about two cores a
    # compile): eight workers (pytest-xdist, in the machine's image) compile
    # side by side.
    gpu_tests=(python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -n 8)
    if [ "$1" = study ]; then
        step attention 150 python3 gpu_study.py --json "$results" --parts attention "${mefs[@]}"
        (cd "$here" && step pytest_gpu 260 "${gpu_tests[@]}")
        step e2e_smollm2 150 "${e2e[@]}" --shapes smollm2 --batches 1,32
        step "e2e_${shapes[0]}" 150 "${e2e[@]}" --shapes "${shapes[0]}" --batches 1,32
    else
        for shape in "${shapes[@]}"; do
            step "e2e_$shape" 200 "${e2e[@]}" --shapes "$shape" --batches 1,8,32,64
        done
    fi
    # The results (every log is in $OUT/study.log; only 8 files come back).
    grep -e "^======== " -e "^  {" -e "precompiled" -e " passed" -e " failed" -e "^FAILED" \
        -e "^ERROR" "$OUT/study.log" | cut -c1-600
    ;;
*)
    echo "usage: $0 payload | kernels | stash a|b|c | check | study | families" >&2
    exit 2
    ;;
esac
