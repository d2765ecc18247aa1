#!/usr/bin/env bash
# Installs the Debian servers (and the browser) the tests talk to, if they are missing.
# Idempotent: does nothing when they are already there.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || need+=(docker.io)
# network namespaces for the multi-host tests: ip netns, veth, a bridge, iptables partitions
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || need+=(iproute2)
command -v iptables >/dev/null || [ -x /usr/sbin/iptables ] || need+=(iptables)
# the swarm's image (scripts/build-image.sh): a Debian base made with debootstrap;
# nsenter and unshare (util-linux) make the nodes of tests/_servers/swarm.py
command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
# the CPU-hog nemesis (nbos chaos cpu-hog, tests/chaos): stress-ng on every core
command -v stress-ng >/dev/null || need+=(stress-ng)
# the browser end-to-end tests: Debian's Chromium and its WebDriver, driven by selenium
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
# the JupyterHub tests: the Hub's proxy, configurable-http-proxy, comes from npm (below)
command -v configurable-http-proxy >/dev/null || command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing ${need[*]}: install them (apt-get install ${need[*]}) or run as root" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! command -v configurable-http-proxy >/dev/null; then
  npm install -g --no-fund --no-audit --loglevel=error configurable-http-proxy >/dev/null
fi
