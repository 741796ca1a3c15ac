#!/usr/bin/env bash
# Prepares a backend for direct server return: the VIP on loopback, and ARP settings so
# the backend never answers ARP for the VIP (clients must reach it through the balancer).
# Usage (as root, on each backend): scripts/dsr-backend.sh VIP [VIP ...]
# Undo: ip addr del VIP/32 dev lo (and /128 for IPv6).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 VIP [VIP ...]" >&2; exit 2; }
for vip in "$@"; do
  case "$vip" in
    *:*) ip -6 addr replace "$vip/128" dev lo ;;  # IPv6: no ARP; nothing else to set
    *)   ip addr replace "$vip/32" dev lo ;;
  esac
  echo "dsr-backend: $vip on lo"
done
sysctl -qw net.ipv4.conf.all.arp_ignore=1     # answer ARP only for addresses on the asking interface
sysctl -qw net.ipv4.conf.all.arp_announce=2   # never use the VIP as an ARP source
echo "dsr-backend: arp_ignore=1 arp_announce=2 (persist them in /etc/sysctl.d/ to survive a reboot)"
