#!/bin/bash
# Drive tools/gpu/gpu_checks.sh on a lent GPU machine across several device calls (each call is
# capped at 10 minutes; the machine stays ours while calls follow each other within 30 s).
#
#   bash tools/gpu/gpu_lease.sh start "STEPS" [SECONDS]  # first call: install, start detached, watch
#   bash /tmp/work/tools/gpu/gpu_lease.sh watch SECONDS  # later calls: watch on, copy results out
#
# start: installs the carried wheels (.whl/) into /tmp/site, copies the tree to /tmp/work (later
# calls replace the call's checkout, never the running copy), unpacks a carried FlashInfer build
# (.device/flashinfer_so.tgz, from an earlier machine's step 0) and starts gpu_checks.sh in its own
# process session so it outlives the call. watch: waits until the run says "done" or SECONDS pass,
# then packs /tmp/o into $OUT/results.tgz and prints the phases and the newest lines of each log.
set -u
RUN=/tmp/o
pack() {
  [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz.part" -C "$RUN" --exclude flashinfer_so.tgz . 2>/dev/null \
    && mv -f "$OUT/results.tgz.part" "$OUT/results.tgz"
}
watch() {
  # Packs what has come so far every 30 s: a call killed at its time limit (the device time left
  # can be less than asked; the eleventh session lost a whole call's results so) still returns it.
  local until=$(( $(date +%s) + $1 )) last=0
  while [ "$(date +%s)" -lt "$until" ] && ! grep -qE " done$|stopping" "$RUN/phases.txt" 2>/dev/null; do
    sleep 5
    [ $(( $(date +%s) - last )) -ge 30 ] && { pack; last=$(date +%s); }
  done
  pack && { [ -f "$RUN/flashinfer_so.tgz" ] && [ -n "${OUT:-}" ] && cp "$RUN/flashinfer_so.tgz" "$OUT/"; true; }
  echo "== phases =="; cat "$RUN/phases.txt" 2>/dev/null
  for f in "$RUN"/*.txt; do
    [ "$(basename "$f")" = phases.txt ] && continue
    echo "== $(basename "$f") =="; tail -n 6 "$f"
  done
  echo "== driver.log =="; tail -n 40 "$RUN/driver.log" 2>/dev/null
  grep -qE " done$|stopping" "$RUN/phases.txt" 2>/dev/null && echo "RUN DONE" || echo "RUN STILL GOING"
}
case ${1:?start or watch} in
  start)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    mkdir -p /tmp/work /tmp/pkg "$RUN" /tmp/fi
    # A machine still warm from an earlier start holds that run's results (packed already) and its
    # "done" line, which would end this start's watch at once: clear them (not a FlashInfer build).
    find "$RUN" -mindepth 1 ! -name flashinfer_so.tgz -delete 2>/dev/null
    tar cf - --exclude=./.whl --exclude=./.git . | tar xf - -C /tmp/work
    ln -sfn /tmp/work /tmp/pkg/phloem
    [ -f .device/flashinfer_so.tgz ] && tar xzf .device/flashinfer_so.tgz -C /tmp/fi
    nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
    cd /tmp/work && PYTHONPATH=/tmp/pkg:/tmp/site:/tmp/work setsid nohup bash tools/gpu/gpu_checks.sh "$RUN" "$2" \
      > "$RUN/driver.log" 2>&1 < /dev/null &
    sleep 2
    watch "${3:-540}"
    ;;
  watch) watch "$2" ;;
esac
