#!/usr/bin/env bash
# Make a Docker engine available and build the geofed image, for the
# container tests. Idempotent: every step is skipped when already done.
#
#   1. install docker.io and mmdebstrap with apt-get if missing (needs root;
#      kubectl for the manifest tests is .ci/run's business);
#   2. start dockerd with the vfs storage driver if no engine answers, and
#      wait until it does;
#   3. build the image (deploy/build-image.sh), unless --engine-only.
#
# Exits non-zero, with the reason, when the engine cannot be started.
#
#   .ci/docker-setup.sh [--engine-only] [-- build-image.sh options]
#
# Environment: DOCKERD_LOG (default /tmp/dockerd.log), DOCKER_WAIT_S (default 60).
set -euo pipefail

ENGINE_ONLY=0
BUILD_ARGS=()
while (($#)); do
  case $1 in
    --engine-only) ENGINE_ONLY=1; shift ;;
    --) shift; BUILD_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "docker-setup: unknown argument: $1" >&2; exit 2 ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG=${DOCKERD_LOG:-/tmp/dockerd.log}
WAIT_S=${DOCKER_WAIT_S:-60}

say() { printf 'docker-setup: %s\n' "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

# --- 1. packages ------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker >/dev/null || missing+=(docker.io)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if ((${#missing[@]})); then
  [[ $(id -u) == 0 ]] || fail "missing ${missing[*]} and not root: install them (apt-get install ${missing[*]})"
  say "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update failed"
  # shellcheck disable=SC2046
  apt-get install -y -qq $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null \
    || fail "apt-get install ${missing[*]} failed"
else
  say "docker, dockerd and mmdebstrap are installed"
fi

# --- 2. engine --------------------------------------------------------------------------
if docker info >/dev/null 2>&1; then
  say "a Docker engine is running ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
else
  [[ $(id -u) == 0 ]] || fail "no Docker engine answers and starting dockerd needs root"
  if pgrep -x dockerd >/dev/null; then
    say "dockerd is running but not answering yet; waiting"
  else
    say "starting dockerd --storage-driver=vfs (log: $LOG)"
    # vfs works on any filesystem (overlayfs inside a container often does not).
    nohup dockerd --storage-driver=vfs >"$LOG" 2>&1 &
  fi
  for ((i = 0; i < WAIT_S; i++)); do
    docker info >/dev/null 2>&1 && break
    if ! pgrep -x dockerd >/dev/null; then
      tail -n 15 "$LOG" >&2 || true
      fail "dockerd exited (see above and $LOG)"
    fi
    sleep 1
  done
  if ! docker info >/dev/null 2>&1; then
    tail -n 15 "$LOG" >&2 || true
    fail "the Docker engine did not answer within ${WAIT_S}s (see $LOG)"
  fi
  say "Docker engine ready ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
fi

# --- 3. image ---------------------------------------------------------------------------
if ((ENGINE_ONLY)); then
  exit 0
fi
say "building the geofed image: deploy/build-image.sh ${BUILD_ARGS[*]:-}"
"$REPO/deploy/build-image.sh" "${BUILD_ARGS[@]}" || fail "the image build failed"
