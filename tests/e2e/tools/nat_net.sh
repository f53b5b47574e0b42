# A carrier NAT in network namespaces for the e2e tests of nodes that accept no connection
# (source it; run as root). The caller names the namespaces and the two /24 prefixes:
#   nat_net_up PUB CAR PH A B
#     PUB  "public": pub0 = A.1 (relay, market, seed and nodes that accept inbound links)
#     CAR  "carrier": wan = A.2, lan = B.1; forwards lan -> wan with nftables masquerade and
#          drops every new flow from wan to lan (only replies to the inside's own flows pass)
#     PH   "phone": ph0 = B.2, default route via the carrier
#   PUB even knows a route to B.0/24 via the carrier: only the NAT keeps the phone unreachable.
# The caller removes the namespaces (ip netns del) in its cleanup.
nat_net_up() {
  local pub=$1 car=$2 ph=$3 a=$4 b=$5 n
  for n in $pub $car $ph; do ip netns add $n && ip -n $n link set lo up || return 1; done
  ip link add wan netns $car type veth peer name pub0 netns $pub || return 1
  ip link add lan netns $car type veth peer name ph0 netns $ph || return 1
  ip -n $pub addr add $a.1/24 dev pub0 && ip -n $pub link set pub0 up &&
    ip -n $car addr add $a.2/24 dev wan && ip -n $car link set wan up &&
    ip -n $car addr add $b.1/24 dev lan && ip -n $car link set lan up &&
    ip -n $ph addr add $b.2/24 dev ph0 && ip -n $ph link set ph0 up &&
    ip -n $ph route add default via $b.1 &&
    ip -n $pub route add $b.0/24 via $a.2 &&
    ip netns exec $car sysctl -qw net.ipv4.ip_forward=1 || return 1
  ip netns exec $car nft -f - <<NFT
table ip kvnat {
  chain nat_out { type nat hook postrouting priority 100; oifname "wan" masquerade; }
  chain filter_fwd {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }
}
NFT
}
