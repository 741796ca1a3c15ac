#!/usr/bin/env bash
# Katran vs lb, per packet: build Katran's balancer from a Katran git dir, start the lb
# agent in a namespace, time both with BPF_PROG_TEST_RUN (kbench.c), then the memory
# latency (memlat.c). Everything it makes lives in $WORK, kb-* namespaces and /run/kb-bpf,
# and is removed on exit. Needs root.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KATRAN_GIT=${KATRAN_GIT:?set KATRAN_GIT to a Katran git dir (fetch github:facebookincubator/katran, or git clone --bare)}
KATRAN_REV=${KATRAN_REV:-HEAD}
LB=${LB:-$PWD/target/release/lb}   # run from the project checkout
EMPTY_OBJ=${EMPTY_OBJ:-}   # default: xdp_pass.c, built into $WORK
WORK=${WORK:-/tmp/katran}
ROUNDS=${ROUNDS:-7} CALLS=${CALLS:-20000} CPU=${CPU:-1}
OUT=${OUT:-$WORK/results}
# lb's attach mode: native (lb reads each frame's length without a kernel helper, and
# the veth's other end gets `lb peer attach`, without which native XDP_TX frames are
# dropped there) or generic (the helper; the shared harness's choice).
XDP_MODE=${XDP_MODE:-native}
# 1: the VIP gets `stable_slots = true`.
STABLE_SLOTS=${STABLE_SLOTS:-0}
BPFFS=/run/kb-bpf
LB_PID=

cleanup() {
	set +e
	if [ -n "$LB_PID" ]; then kill -CONT "$LB_PID"; kill -TERM "$LB_PID"; wait "$LB_PID"; fi
	ip netns del kb-lb 2>/dev/null; ip netns del kb-peer 2>/dev/null
	rm -rf "${BPFFS:?}"/lb
	mountpoint -q $BPFFS && umount $BPFFS; rmdir $BPFFS 2>/dev/null
}
trap cleanup EXIT

# 1. Tools (Debian's), once.
pkgs=(clang-16 llvm-16 libbpf-dev linux-libc-dev gcc bpftool iproute2)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}"
fi

# 2. Katran's sources, from its git dir (e.g. a clone of facebookincubator/katran).
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
git --git-dir="$KATRAN_GIT" archive "$KATRAN_REV" katran/lib/bpf katran/lib/linux_includes | tar -x -C "$WORK"
KATRAN_COMMIT=$(git --git-dir="$KATRAN_GIT" rev-parse "$KATRAN_REV^{commit}")

# 3. Katran's own rule (katran/lib/Makefile-bpf, via build_bpf_modules_opensource.sh,
#    which also copies linux_includes/ into include/), with Debian's clang 16 / llc 16.
cd "$WORK" && mkdir -p include bpf && cp katran/lib/linux_includes/* include/
BUILD="clang-16 -I./usr/include -I./include -I. -DDEBUG -D__KERNEL__ -Wno-unused-value \
-Wno-pointer-sign -Wno-compare-distinct-pointer-types -O2 -emit-llvm -c -g \
katran/lib/bpf/balancer.bpf.c -o - | llc-16 -march=bpf -filetype=obj -o bpf/balancer.bpf.o"
echo "+ $BUILD"
eval "$BUILD"
gcc -O2 -Wall -o "$WORK/kbench" "$HERE/kbench.c" -lbpf
if [ -z "$EMPTY_OBJ" ]; then
	clang-16 -O2 -target bpf -I/usr/include/x86_64-linux-gnu -c "$HERE/xdp_pass.c" -o "$WORK/xdp_pass.o"
	EMPTY_OBJ=$WORK/xdp_pass.o
fi
gcc -O2 -Wall -o "$WORK/memlat" "$HERE/memlat.c"

# 4. lb in namespace kb-lb (veth kb-lb0 <-> kb-peer0 in kb-peer), XDP in $XDP_MODE, three
#    VIPs (10.200.0.1:80/tcp, 10.200.0.1:80/udp, [fd00:200::1]:80/tcp) with 100 backends
#    each, of fixed MACs, and no health checks.
mkdir -p $BPFFS && { mountpoint -q $BPFFS || mount -t bpf bpf $BPFFS; }
ip netns add kb-lb && ip netns add kb-peer
ip link add kb-lb0 netns kb-lb type veth peer name kb-peer0 netns kb-peer
ip -n kb-lb addr add 10.200.0.2/24 dev kb-lb0 && ip -n kb-peer addr add 10.200.0.3/24 dev kb-peer0
ip -n kb-lb addr add fd00:200::2/64 dev kb-lb0 nodad
ip -n kb-lb link set kb-lb0 up && ip -n kb-peer link set kb-peer0 up
{
	printf '[dataplane]\ninterface = "kb-lb0"\nxdp_mode = "%s"\npin_path = "%s/lb"\n\n' "$XDP_MODE" $BPFFS
	printf '[control]\nsocket = "%s/lb.sock"\nmetrics = "off"\n\n' "$WORK"
	# The TCP VIP (backends' MACs 02:00:00:00:01:xx), the same address's UDP port 80
	# (03:xx) and an IPv6 TCP VIP (02:xx), each with 100 backends.
	vip() { # name address protocol backend-address-format backend-offset mac-byte
		printf '[[vip]]\nname = "%s"\naddress = "%s"\nport = 80\nprotocol = "%s"\n' "$1" "$2" "$3"
		if [ "$STABLE_SLOTS" = 1 ] && [ "$3" = tcp ]; then printf 'stable_slots = true\n'; fi
		printf '\n[vip.health]\nkind = "none"\n'
		for i in $(seq 1 100); do
			printf '\n[[vip.backend]]\naddress = "'"$4"'"\nmac = "02:00:00:00:%s:%02x"\n' \
				$((i + $5)) "$6" "$i"
		done
		printf '\n'
	}
	vip bench 10.200.0.1 tcp '10.200.0.%d' 100 01
	vip bench-udp 10.200.0.1 udp '10.200.0.%d' 100 03
	vip bench6 fd00:200::1 tcp 'fd00:200::1:%x' 0 02
} > "$WORK/lb.toml"
"$LB" check --config "$WORK/lb.toml"
[ "$XDP_MODE" = native ] && nsenter --net=/run/netns/kb-peer "$LB" peer attach kb-peer0 --pin-path $BPFFS/peer
ip netns exec kb-lb "$LB" run --config "$WORK/lb.toml" --detach-on-exit > "$WORK/lb.log" 2>&1 &
LB_PID=$!
lb_ready() { # the link is pinned and all 300 backends hold Maglev slots
	[ -e $BPFFS/lb/link ] && "$LB" status --socket "$WORK/lb.sock" --json 2>/dev/null | python3 -c '
import json, sys
b = [b for v in json.load(sys.stdin)["vips"] for b in v["backends"]]
sys.exit(not (len(b) == 300 and all(x["in_table"] and x["slots"] > 0 for x in b)))'
}
for _ in $(seq 100); do lb_ready && break; sleep 0.2; done
lb_ready || { echo "lb did not get ready; see $WORK/lb.log" >&2; exit 1; }
"$LB" status --socket "$WORK/lb.sock" | head -5
kill -STOP "$LB_PID" # the agent's periodic work is paused while we measure (Katran has none)

# 5. Measure.
{
	echo "katran commit: $KATRAN_COMMIT"
	echo "katran build: $BUILD"
	echo "lb: $(basename "$LB") of the project checkout ($(git -C "$(dirname "$LB")/../.." rev-parse HEAD 2>/dev/null || echo '?'))"
	echo "kernel: $(uname -r); cpus: $(nproc); bench CPU: $CPU; rounds: $ROUNDS; calls: $CALLS"
	echo "lb: xdp_mode = $XDP_MODE, stable_slots = $STABLE_SLOTS"
	echo "uptime before: $(uptime)"
	"$WORK/kbench" "$WORK/bpf/balancer.bpf.o" "$EMPTY_OBJ" $BPFFS/lb/link "$ROUNDS" "$CALLS" "$CPU" "$OUT/rounds.tsv"
	echo "uptime after:  $(uptime)"
	echo
	echo "memory latency (random pointer chase, taskset -c $CPU):"
	taskset -c "$CPU" "$WORK/memlat"
	echo "uptime end:    $(uptime)"
} 2>&1 | tee "$OUT/summary.txt"
