#!/usr/bin/env bash
# The deployment checks of docs/deploy.md ("Checks"), without a container engine:
#   bash scripts/ci_deploy_checks.sh          # fails if a tool is missing (CI installs them)
# Needs: apt-get install -y docker-compose prometheus
#        pip install -c /tmp/constraints.txt helm-python-sdk kubernetes-validate dockerfile
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for tool in docker-compose promtool prometheus; do
  command -v "$tool" >/dev/null || missing+=("$tool (apt-get install docker-compose prometheus)")
done
for module in helm_python kubernetes_validate dockerfile; do
  python -c "import $module" 2>/dev/null || missing+=("python module $module (pip install helm-python-sdk kubernetes-validate dockerfile)")
done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'ci_deploy_checks: missing %s\n' "${missing[@]}" >&2
  exit 2
fi
docker-compose --env-file .env.example config -q
promtool check rules monitoring/alerts/fleetrl.rules.yml
promtool test rules monitoring/alerts/fleetrl.rules.test.yml
python -m pytest -q tests/deploy
