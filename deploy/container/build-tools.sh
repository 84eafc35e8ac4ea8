#!/bin/sh
# Builder stages only: give `pip install .` what it needs to compile the core
# (a C compiler, libc and Python headers) and a venv module, with the base's
# package manager, installing only what the base lacks. Never in a final stage.
#   build-tools.sh PYTHON
set -eu
python="${1:-python3}"
version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
need=""
command -v cc >/dev/null 2>&1 || need="$need gcc libc6-dev"
"$python" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || need="$need python$version-dev"
"$python" -c 'import ensurepip, venv' 2>/dev/null || need="$need python$version-venv"
[ -z "$need" ] && exit 0
if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    # shellcheck disable=SC2086  # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need
    rm -rf /var/lib/apt/lists/*
else
    echo "build-tools.sh: no apt-get to install:$need" >&2
    exit 1
fi
