#!/bin/bash
# Every wheel a device call needs, into .whl/ (git-ignored; name it in `carry`): the shared list
# (../shared/gpu/fetch-wheels.sh: the server stack, fla-core, FlashInfer), then what the grammar,
# Responses and OpenAI-client tests import there, at the versions installed here (the GPU image
# has none of them; openai 3.x imports httpx2, which needs httpcore2 and truststore), and the external
# harness of `phloem bench trie` (tokenspeed-trie; the image has its transformers and rich, not chz or structlog).
#   bash tools/gpu/fetch_wheels.sh            # from the repository root, on this machine
set -euo pipefail
dest=${1:-.whl}
bash ../shared/gpu/fetch-wheels.sh "$dest"
pinned=()
for pkg in xgrammar pydantic pydantic-core annotated-types typing-inspection jsonschema \
           jsonschema-specifications referencing rpds-py openai distro jiter httpx2 httpcore2 truststore h11 \
           tokenspeed-trie chz structlog; do
  version=$(python3 -m pip show "$pkg" 2>/dev/null | sed -n 's/^Version: //p')
  pinned+=("$pkg${version:+==$version}")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${pinned[@]}"
du -sh "$dest"
