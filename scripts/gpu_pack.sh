# After scripts/gpu_check.py on a lent GPU machine: what comes back of DIR within the device's limits (8 files, no
# deeper than 2 folders): report.json, report.md, and the logs with every step's JSON in one tarball.
#   sh scripts/gpu_pack.sh /tmp/gpu-report "$OUT"
report=${1:?the report folder}; out=${2:?where to put what comes back}
mkdir -p "$out"
cp "$report/report.json" "$report/report.md" "$out/" 2>/dev/null || echo "gpu_pack: no report in $report"
# the steps' logs and JSON, and the sharded runs' own logs (their checkpoints stay behind)
(cd "$report" && tar czf "$out/logs.tgz" logs $(ls *.json *.xml *.txt profile_*.md sharded_*/*.log 2>/dev/null)) && ls -la "$out"
