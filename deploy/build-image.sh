#!/usr/bin/env bash
# Build the geofed broker image (deploy/Dockerfile) on a machine that may have
# no image registry:
#
#   1. base image: unless --base is given, a Debian bookworm root filesystem
#      with python3 and python3-venv, made by mmdebstrap from this machine's
#      own apt sources and loaded with `docker import` (tarball cached);
#   2. wheels: `pip wheel` of the project on this machine, i.e. geofed and its
#      runtime dependencies (the [project] dependencies in pyproject.toml and
#      its `image` extra: psycopg for history_dsn, paho-mqtt and h3 for
#      bridge-topics), pinned to the versions installed in its Python environment;
#   3. docker build --build-arg BASE=<base> (pip installs geofed from those
#      wheels, resolving its dependencies, then runs `geofed --help`).
#
# Repeated runs reuse the base image (or its cached tarball), pip's cache and
# Docker's layer cache. With a registry, `--base python:3.11-slim-bookworm`
# skips step 1. See deploy/DEPLOY.md.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: deploy/build-image.sh [options]

  --tag TAG           image to build (default: $GEOFED_IMAGE or geofed:dev)
  --base IMAGE        base image to use as is (default: build geofed-base:SUITE
                      with mmdebstrap; also $GEOFED_BASE_IMAGE)
  --suite SUITE       Debian suite for the mmdebstrap base (default: bookworm)
  --apt-sources FILE  apt sources for mmdebstrap (default: this machine's
                      /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list)
  --python PY         Python that builds the wheels and can import geofed's
                      runtime dependencies; its minor version must match the
                      base image's python3 (default: the repo's
                      .venv/bin/python, else python3)
  --cache-dir DIR     base tarball and build context (default:
                      $GEOFED_IMAGE_CACHE or ~/.cache/geofed-image)
  --refresh-base      rebuild the base image even if cached
  -h, --help          this text
EOF
}

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'build-image: error: %s\n' "$*" >&2; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${GEOFED_IMAGE:-geofed:dev}
BASE=${GEOFED_BASE_IMAGE:-}
SUITE=bookworm
APT_SOURCES=
PY=
CACHE=${GEOFED_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/geofed-image}
REFRESH_BASE=0
# python3-venv brings ensurepip (hence pip) for the build stage; ca-certificates
# lets a user's pip reach an index over HTTPS when PIP_INDEX_ARGS="".
BASE_PACKAGES=python3,python3-venv,ca-certificates

while (($#)); do
  case $1 in
    --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
    --base) BASE=${2:?--base needs a value}; shift 2 ;;
    --suite) SUITE=${2:?--suite needs a value}; shift 2 ;;
    --apt-sources) APT_SOURCES=${2:?--apt-sources needs a value}; shift 2 ;;
    --python) PY=${2:?--python needs a value}; shift 2 ;;
    --cache-dir) CACHE=${2:?--cache-dir needs a value}; shift 2 ;;
    --refresh-base) REFRESH_BASE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

if [[ -z $PY ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
command -v docker >/dev/null || die "docker CLI not found (install docker.io; .ci/docker-setup.sh does)"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is dockerd running? .ci/docker-setup.sh starts one)"
# The classic builder needs no buildx plugin and no frontend image from a registry.
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
mkdir -p "$CACHE"
# One build at a time per cache directory (the build context lives there).
exec 9>"$CACHE/.lock"
if command -v flock >/dev/null && ! flock -n 9; then
  log "another build is using $CACHE; waiting for it"
  flock 9
fi
start=$SECONDS

# --- 1. base image ----------------------------------------------------------
build_base() {
  local sources key tarball
  if [[ -z $APT_SOURCES ]]; then
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
      if [[ -s $f ]]; then APT_SOURCES=$f; break; fi
    done
  fi
  [[ -n $APT_SOURCES && -r $APT_SOURCES ]] || die "no apt sources found; pass --apt-sources FILE or --base IMAGE"
  sources=$APT_SOURCES
  key=$( { echo "$SUITE $BASE_PACKAGES"; cat "$sources"; } | sha256sum | cut -c1-12)
  BASE=geofed-base:$SUITE
  tarball=$CACHE/geofed-base-$SUITE-$key.tar

  if ((!REFRESH_BASE)) && [[ $(docker image inspect -f '{{index .Config.Labels "org.geofed.base-key"}}' "$BASE" 2>/dev/null) == "$key" ]]; then
    log "base image $BASE is current (key $key)"
    return
  fi
  if ((REFRESH_BASE)) || [[ ! -s $tarball ]]; then
    command -v mmdebstrap >/dev/null || die "mmdebstrap not found (apt-get install mmdebstrap), or pass --base IMAGE"
    log "building the $SUITE root filesystem with mmdebstrap from $sources -> $tarball"
    rm -rf "$tarball.partial"
    mmdebstrap --variant=apt --format=tar --include="$BASE_PACKAGES" --quiet \
      "$SUITE" "$tarball.partial" "$sources" || die "mmdebstrap failed (see above)"
    mv "$tarball.partial" "$tarball"
  else
    log "reusing cached root filesystem $tarball"
  fi
  py=$(tar -tf "$tarball" | sed -n 's|^\./usr/bin/python\(3\.[0-9][0-9]*\)$|\1|p' | sort -V | tail -n 1)
  [[ -n $py ]] || die "no python3 in $tarball"
  log "docker import $tarball as $BASE (Python $py)"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL org.geofed.base-key=$key org.geofed.python=$py" \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$BASE" >/dev/null
}

if [[ -z $BASE ]]; then
  build_base
else
  log "using base image $BASE as given"
fi

# The wheels are built here and installed there: same CPython minor version.
host_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "cannot run $PY"
base_py=$(docker image inspect -f '{{index .Config.Labels "org.geofed.python"}}' "$BASE" 2>/dev/null || true)
if [[ -z $base_py ]]; then
  # Not an image of ours: ask its python3 (under vfs a container costs ~20 s).
  base_py=$(docker run --rm --entrypoint python3 "$BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
    || die "cannot run python3 in $BASE"
fi
[[ $host_py == "$base_py" ]] || die "$PY is Python $host_py but $BASE has Python $base_py; pass --python with a $base_py interpreter"
log "Python $host_py on both sides ($PY, $BASE)"

# --- 2. wheels ----------------------------------------------------------------
CTX=$CACHE/context
rm -rf "$CTX"
mkdir -p "$CTX/wheels" "$CTX/dist"
cp "$REPO/deploy/image/healthcheck.py" "$CTX/"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
# Pin to what this environment runs (and was tested with); drop editable and
# direct-URL entries such as geofed itself.
"$PY" -m pip freeze --exclude-editable --disable-pip-version-check | grep -v -e '^-e ' -e ' @ ' -e '^#' \
  >"$src.constraints" || true
trap 'rm -rf "$src" "$src.constraints"' EXIT
# Build from a snapshot so that nothing is written into the working tree.
tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude=.mypy_cache --exclude=.ruff_cache --exclude=.pytest_cache \
  --exclude=.hypothesis --exclude=./out --exclude=./reports -cf - . | tar -C "$src" -xf -
log "building the wheels of geofed and its runtime dependencies (pyproject.toml, extra image)"
# A fixed timestamp makes the geofed wheel byte-identical for identical
# sources, so Docker's layer cache holds across runs.
SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel --quiet --disable-pip-version-check \
  --wheel-dir "$CTX/wheels" -c "$src.constraints" "$src[image]" || die "pip wheel of $REPO failed"
shopt -s nullglob
project=("$CTX"/wheels/geofed-*.whl)
shopt -u nullglob
((${#project[@]} == 1)) || die "pip wheel made no single geofed wheel in $CTX/wheels"
mv "${project[0]}" "$CTX/dist/"
project=$CTX/dist/${project[0]##*/}
# The image installs exactly these wheels: pin them (and nothing else, so that
# unrelated changes to this environment keep Docker's cache valid).
for whl in "$CTX"/wheels/*.whl; do
  IFS=- read -r name ver _ <<<"${whl##*/}"
  echo "$name==$ver"
done | sort >"$CTX/constraints.txt"
ls "$CTX/dist" "$CTX/wheels" | sed 's/^/    /' >&2
# The ports the image exposes are the node's defaults, read from the wheel
# just built (it is importable from its zip file).
read -r client_port peer_port metrics_port < <(
  PYTHONPATH=$project "$PY" -c \
    'from geofed.node import CLIENT_PORT, METRICS_PORT, PEER_PORT; print(CLIENT_PORT, PEER_PORT, METRICS_PORT)'
) || die "$PY cannot import geofed.node from the wheel (does it have geofed's runtime dependencies?)"
log "node ports: client $client_port, peer $peer_port, metrics $metrics_port"

# --- 3. image -------------------------------------------------------------------
version=$("$PY" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$REPO/pyproject.toml")
revision=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ $revision != unknown && -n $(git -C "$REPO" status --porcelain 2>/dev/null | head -1) ]]; then
  revision=$revision-dirty
fi
log "docker build -t $TAG (base $BASE, version $version, revision $revision)"
# The wheels stage gets a tag of its own (one per image tag, so that builds of
# different tags keep each other's) so that its layers (the slow pip install)
# stay cached while superseded images are pruned below.
stage_tag=geofed-build:wheels-$(tr -c 'A-Za-z0-9_.\n-' '-' <<<"$TAG")
if ! docker build --build-arg "BASE=$BASE" --target wheels -t "$stage_tag" \
  -f "$REPO/deploy/Dockerfile" "$CTX" >"$CACHE/docker-build.log" 2>&1; then
  tail -n 40 "$CACHE/docker-build.log" >&2
  die "docker build of the wheels stage failed (full log: $CACHE/docker-build.log)"
fi
if ! docker build --build-arg "BASE=$BASE" --build-arg "CLIENT_PORT=$client_port" \
  --build-arg "PEER_PORT=$peer_port" --build-arg "METRICS_PORT=$metrics_port" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$revision" -t "$TAG" -f "$REPO/deploy/Dockerfile" "$CTX" \
  >>"$CACHE/docker-build.log" 2>&1; then
  tail -n 40 "$CACHE/docker-build.log" >&2
  die "docker build failed (full log: $CACHE/docker-build.log)"
fi
# Untagged images built on our base are earlier builds; with the vfs storage
# driver each one costs its full size on disk.
docker image prune --force --filter label=org.geofed.base-key >/dev/null || true

size=$(docker image inspect -f '{{.Size}}' "$TAG")
log "built $TAG ($((size / 1000000)) MB) in $((SECONDS - start)) s"
