#!/usr/bin/env bash
# Builds the nbos image (deploy/docker/Dockerfile) without any registry:
#   1. a Debian bookworm base (python3, its venv module, redis-server) made with debootstrap
#      from Debian's mirror and `docker import`ed; its tarball is cached under $NBOS_IMAGE_CACHE
#      keyed by its inputs, so a second build skips this step;
#   2. nbos and its dependencies built as wheels here (`pip wheel`, this machine's indexes);
#   3. `docker build` of the Dockerfile over those wheels.
# Usage: scripts/build-image.sh [--tag nbos:latest] [--torch] [--base IMAGE]
#   --torch       also install torch==2.13.0: the CPU wheel this machine's pip finds, and
#                 refused if pip found a CUDA build (one that pulls nvidia-* wheels)
#   --base IMAGE  build FROM IMAGE (e.g. python:3.11-slim where a registry is reachable)
#                 instead of the debootstrapped base
# The docker CLI talks to $DOCKER_HOST (or the default engine). Needs root for debootstrap.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
tag=nbos:latest
torch=0
base=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=${2:?--tag needs a value}; shift 2 ;;
    --torch) torch=1; shift ;;
    --base) base=${2:?--base needs a value}; shift 2 ;;
    *) echo "build-image.sh: unknown argument $1 (--tag TAG, --torch, --base IMAGE)" >&2; exit 2 ;;
  esac
done
python=${NBOS_BUILD_PYTHON:-python3}
cache=${NBOS_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nbos-image}
mirror=${NBOS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm
packages=python3,python3-venv,redis-server
mkdir -p "$cache"

# The classic builder where the CLI has no buildx (Debian's docker.io): it needs nothing else.
if ! docker buildx version >/dev/null 2>&1; then
  export DOCKER_BUILDKIT=0
fi

debian_base() {
  local key tarball root image
  key=$(printf 'v1 %s %s %s minbase\n' "$suite" "$mirror" "$packages" | sha256sum | cut -c1-12)
  tarball="$cache/base-$suite-$key.tar"
  image="nbos-base:$suite-$key"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { echo "debootstrap is missing (scripts/system-deps.sh)" >&2; exit 1; }
    root=$(mktemp -d "$cache/root.XXXXXX")
    trap 'rm -rf "$root"' RETURN
    echo "base: debootstrap $suite ($packages) from $mirror" >&2
    debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >&2
    # What a container never reads: package lists, downloaded .debs, docs, manuals, locales.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
      "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" --numeric-owner -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
  fi
  if ! docker image inspect "$image" >/dev/null 2>&1; then
    docker import "$tarball" "$image" >/dev/null
  fi
  docker tag "$image" "nbos-base:$suite"
  echo "$image"
}

if [ -z "$base" ]; then
  base=$(debian_base)
fi

context=$(mktemp -d "${TMPDIR:-/tmp}/nbos-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
cp "$repo/deploy/docker/Dockerfile" "$context/"
mkdir "$context/wheels"
extras=redis,docker
[ "$torch" = 1 ] && extras=$extras,torch
echo "wheels: nbos[$extras]" >&2
# pip resolves for the Python running it; bookworm's is 3.11.2, where redis also needs
# async-timeout (python_full_version < "3.11.3"), which a newer 3.11 does not pull.
"$python" -m pip wheel --quiet --wheel-dir "$context/wheels" "$repo[$extras]" async-timeout >&2
if [ "$torch" = 1 ] && ls "$context/wheels" | grep -qi '^nvidia'; then
  echo "torch: pip found a CUDA build (nvidia-* wheels); only a CPU wheel goes in the image" >&2
  exit 1
fi
version=$("$python" -c 'import runpy,sys; print(runpy.run_path(sys.argv[1])["__version__"])' "$repo/nbos/_version.py")
echo "nbos[$extras]==$version" >"$context/wheels/requirements.txt"
echo "image: $tag from $base" >&2
docker build --quiet --build-arg "BASE=$base" --tag "$tag" "$context" >&2
echo "$tag"
