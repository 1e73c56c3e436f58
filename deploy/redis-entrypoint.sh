#!/bin/sh
# Redis for the compose stack: a password (env RLMESH_REDIS_PASSWORD, never argv), the default user
# off, one ACL user for the services limited to rlmesh's keys and to no dangerous command, protected
# mode on, and a memory bound past which writes fail instead of evicting stream entries.
set -eu
password="${RLMESH_REDIS_PASSWORD:-}"
if [ -z "$password" ]; then
  echo "redis: set RLMESH_REDIS_PASSWORD (make compose-env writes one into .env)" >&2
  exit 2
fi
case "$password" in
  *[!A-Za-z0-9._~-]*)
    echo "redis: RLMESH_REDIS_PASSWORD may hold only letters, digits and . _ ~ - (it goes in a URL)" >&2
    exit 2;;
esac
umask 077
conf="${TMPDIR:-/tmp}/rlmesh-redis.conf"
cat > "$conf" <<CONF
user default off resetpass -@all
user rlmesh on >$password ~rlmesh:* resetchannels -@all +@all -@dangerous +client|id +client|unblock +client|setname
maxmemory ${RLMESH_REDIS_MAXMEMORY:-2gb}
maxmemory-policy noeviction
protected-mode yes
CONF
unset RLMESH_REDIS_PASSWORD password
exec redis-server "$conf" --bind 0.0.0.0 --dir "${RLMESH_REDIS_DIR:-/data}" "$@"
