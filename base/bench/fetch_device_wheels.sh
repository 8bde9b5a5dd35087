#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (it has torch, triton and transformers, no package registry), downloaded
# here into .whl/ for its Python 3.12; carry the folder with each device call (`carry: [".whl"]`), and
# bench/gpu_session.sh installs it there. The serving stages need the HTTP stack, xgrammar is imported by the
# scheduler, jsonschema by test/test_grammar.py (whose import error would stop a whole GPU test run).
#
#     bash bench/fetch_device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 \
    opentelemetry-api==1.45.2 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 xgrammar==0.2.8 \
    apache-tvm-ffi==0.1.15.post2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 attrs==26.1.0
ls .whl | wc -l
