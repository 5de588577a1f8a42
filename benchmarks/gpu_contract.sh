#!/usr/bin/env bash
exec python "$(dirname "$0")/run.py" --suite gpu-tests,generate --generate.models t5-small,t5-large --generate.parity t5-small ${OUT:+--out "$OUT"} "$@"
