# Throw-away node keys for e2e tests that start stages by hand (source it;
# needs KVASIR_BIN). Every link of such a ring is TLS between these keys.
#   ring_keys DIR N      makes DIR/k0.key .. DIR/k(N-1).key (kept if there)
#   key_pub DIR R        prints rank R's public key (64 hex digits)
#   key_args DIR R N     prints rank R's trust flags in a ring of N ranks:
#                        --key DIR/kR.key --prev-key ... --next-key ...
ring_keys() {
  local d=$1 n=$2 r
  for ((r = 0; r < n; r++)); do
    [ -f "$d/k$r.key" ] || "$KVASIR_BIN" key gen -o "$d/k$r.key" >/dev/null || return 1
  done
}
key_pub() { "$KVASIR_BIN" key show --public "$1/k$2.key"; }
key_args() {
  local d=$1 r=$2 n=$3
  echo "--key $d/k$r.key --prev-key $(key_pub "$d" $(((r + n - 1) % n))) --next-key $(key_pub "$d" $(((r + 1) % n)))"
}
