#!/usr/bin/env bash
# Build or reuse capsa's container image localhost/capsa:dev without a registry: see scripts/build_image.py.
exec python3 "$(dirname "${BASH_SOURCE[0]}")/build_image.py" "$@"
