#!/usr/bin/env bash
# Debian packages the tests use, installed where this runs as root with apt-get (else a note):
# chromium (the server page's browser test) and, on Linux, libopenblas0-pthread
# (tools/with_openblas.sh). One that cannot be installed leaves the others.
set -uo pipefail
wanted=()
command -v chromium >/dev/null || wanted+=(chromium)
if [ "$(uname -s)" = Linux ] && [ ! -e "/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3" ]; then
    wanted+=(libopenblas0-pthread)
fi
[ ${#wanted[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "note: not installed: ${wanted[*]} (Debian packages; without them some tests skip or run slower)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive  # beside the Python install (make -j2) it has no terminal to ask on
apt-get update -qq || { echo "note: apt-get update failed; not installed: ${wanted[*]}" >&2; exit 0; }
for package in "${wanted[@]}"; do
    apt-get install -y -qq "$package" >/dev/null || echo "note: apt-get could not install $package" >&2
done
exit 0
