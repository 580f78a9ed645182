#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, for drills: each node is a real raylet with
# its own workers and object store. The head runs no training and serves the dashboard
# (job submission) on http://127.0.0.1:8265. Health checks are tightened so a killed
# node is declared dead in under 1 s.
#
#   cluster/local-cluster.sh start [NODES] [CPUS_PER_NODE]   # default 3 nodes x 2 CPUs
#
# A second cluster beside the first: MEMCKPT_CLUSTER_DIR=/tmp/second MEMCKPT_DASHBOARD_PORT=0
# (0: any free port; every other port of every node is picked by Ray itself).
#   cluster/local-cluster.sh status
#   cluster/local-cluster.sh stop
set -euo pipefail
state="${MEMCKPT_CLUSTER_DIR:-/tmp/memckpt-local-cluster}"
mkdir -p "$state"
case "${1:-}" in
  start)
    if [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; then
      echo "already running (pid $(cat "$state/pid")):"; cat "$state/ready.json"; echo; exit 0
    fi
    rm -f "$state/ready.json"
    RAY_AUTH_MODE=disabled nohup python -m memckpt.runtime.tools.local_cluster --nodes "${2:-3}" \
      --cpus-per-node "${3:-2}" \
      --dashboard-port "${MEMCKPT_DASHBOARD_PORT:-8265}" --ready-file "$state/ready.json" >"$state/cluster.log" 2>&1 &
    echo $! >"$state/pid"
    for _ in $(seq 1 240); do
      [ -f "$state/ready.json" ] && { cat "$state/ready.json"; echo;
        echo "export RAY_AUTH_MODE=disabled RAY_ADDRESS=$(python -c "import json;print(json.load(open('$state/ready.json'))['address'])")"; exit 0; }
      kill -0 "$(cat "$state/pid")" 2>/dev/null || { tail -n 30 "$state/cluster.log"; exit 1; }
      sleep 0.5
    done
    echo "cluster did not come up; see $state/cluster.log"; exit 1 ;;
  status)
    [ -f "$state/ready.json" ] && cat "$state/ready.json" && echo || echo "not running" ;;
  stop)
    if [ -f "$state/pid" ]; then kill -TERM "$(cat "$state/pid")" 2>/dev/null || true
      for _ in $(seq 1 120); do kill -0 "$(cat "$state/pid")" 2>/dev/null || break; sleep 0.5; done
      rm -f "$state/pid" "$state/ready.json"; echo stopped
    else echo "not running"; fi ;;
  *) echo "usage: $0 start [NODES] [CPUS_PER_NODE] | status | stop"; exit 2 ;;
esac
