#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, NumPy, SciPy, Matplotlib, Rich,
# tokenizers and safetensors; not these, nor perhaps xxhash), for its Python 3.12 on x86-64, into .whl/ (ignored by
# git): run once here, then carry .whl in the device call that runs benchmarks/gpu_session.sh.
# The versions are this project's venv's; torchao (the suite's float8 ablation, an optional extra)
# is 0.17.0, whose float8 training imports and converts the model under torch 2.11, the image's.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    ftfy==6.3.1 wcwidth==0.9.4 rensa==0.5.0 xxhash==4.1.0 torchao==0.17.0
ls .whl
