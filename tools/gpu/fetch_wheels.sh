#!/bin/bash
# Every wheel a device call needs (git-ignored; name the folders in `carry`), from the repository
# root on this machine, at the versions installed here (the GPU image has none of them):
#   .whl/         the shared list (../shared/gpu/fetch-wheels.sh: the server stack, fla-core,
#                 FlashInfer), then what the server's grammars and Responses schemas import;
#   .whl-client/  what only clients import: the OpenAI-client tests (openai 3.x imports httpx2,
#                 which needs httpcore2 and truststore) and `phloem bench trie`'s external harness
#                 (tokenspeed-trie; the image has its transformers and rich, not chz or structlog).
# A call's carry is capped at 64 MiB with the tracked tree (~21 MiB): .whl (~31 MiB) with the
# packed kernel caches (.gpu-cache, ~10 MiB) fits; add .whl-client (~3 MiB) only where a client
# test or the trie harness runs. tools/gpu/setup.sh installs whichever of the two is there.
#   bash tools/gpu/fetch_wheels.sh
set -euo pipefail
bash ../shared/gpu/fetch-wheels.sh .whl
pinned() {
  for pkg in "$@"; do
    version=$(python3 -m pip show "$pkg" 2>/dev/null | sed -n 's/^Version: //p')
    echo "$pkg${version:+==$version}"
  done
}
download() {
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
}
download .whl $(pinned xgrammar pydantic pydantic-core annotated-types typing-inspection jsonschema \
                       jsonschema-specifications referencing rpds-py h11)
download .whl-client $(pinned openai distro jiter httpx2 httpcore2 truststore tokenspeed-trie chz structlog)
du -sh .whl .whl-client
