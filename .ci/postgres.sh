#!/usr/bin/env bash
# A throwaway PostgreSQL server for the job-store tests: installs PostgreSQL if it is missing
# (Debian/Ubuntu, as root), starts a private cluster on a loopback port, makes a role that may
# create databases, and prints its URL as the last line of stdout:
#
#     export VISIONLOOP_TEST_PG_URL="$(bash .ci/postgres.sh)"
#
# Idempotent and safe to run concurrently (a lock serialises callers): a server that is
# already up is reused. It is a *test* server: fsync is off, so it is fast and not durable.
# Its own cluster (not the distribution's `main` one) so it never touches a real database.
#
# Settings: VISIONLOOP_PG_PORT (54329), VISIONLOOP_PG_DIR (/tmp/visionloop-pg-$PORT).
# Stop it with: pg_ctl -D "$VISIONLOOP_PG_DIR/data" stop  (as the user that owns it).
set -euo pipefail

PORT="${VISIONLOOP_PG_PORT:-54329}"
DIR="${VISIONLOOP_PG_DIR:-/tmp/visionloop-pg-$PORT}"
ROLE=vl
PASSWORD=vl
DB=vl_test

log() { echo "postgres.sh: $*" >&2; }
die() {
  log "$*"
  log "Or point the tests at a server of your own: export VISIONLOOP_TEST_PG_URL=postgresql+psycopg://USER:PASS@HOST:PORT/DB (a role with CREATEDB)."
  exit 1
}

find_bindir() {
  local d
  # Debian keeps the server binaries out of PATH, one folder per major version: newest first.
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
      echo "$d"
      return 0
    fi
  done
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v initdb)"
    return 0
  fi
  return 1
}

exec 9>"/tmp/visionloop-pg-$PORT.lock"
flock -w 300 9 || die "another postgres.sh has held /tmp/visionloop-pg-$PORT.lock for 5 minutes."

BIN="$(find_bindir || true)"
if [ -z "$BIN" ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "PostgreSQL is not installed: apt-get install postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed."
    apt-get install -y -qq --no-install-recommends postgresql >&2 || die "apt-get install postgresql failed."
    BIN="$(find_bindir || true)"
  fi
  [ -n "$BIN" ] || die "PostgreSQL is not installed and this script cannot install it here. Install it (sudo apt-get install postgresql, or brew install postgresql) and run again."
fi

# The server refuses to run as root: run it as the `postgres` account the package made.
if [ "$(id -u)" -eq 0 ]; then
  id postgres >/dev/null 2>&1 || die "running as root but there is no 'postgres' user to run the server as."
  OWNER=postgres
  as_owner() { (cd / && runuser -u postgres -- "$@" 9>&-); }
else
  OWNER="$(id -un)"
  # 9>&-: the server must not inherit the lock, or it would hold it for as long as it runs.
  as_owner() { (cd / && "$@" 9>&-); }
fi

psql_admin() {
  as_owner "$BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$DIR" -p "$PORT" -U "$OWNER" -d postgres -tA "$@"
}

mkdir -p "$DIR"
if [ "$(id -u)" -eq 0 ]; then chown "$OWNER" "$DIR"; fi
chmod 700 "$DIR"

if ! as_owner "$BIN/pg_isready" -q -h "$DIR" -p "$PORT"; then
  if [ ! -f "$DIR/data/PG_VERSION" ]; then
    log "creating a test cluster in $DIR/data"
    as_owner "$BIN/initdb" -D "$DIR/data" -U "$OWNER" --auth-local=trust --auth-host=scram-sha-256 \
      --encoding=UTF8 --locale=C >"$DIR/initdb.log" 2>&1 || {
      cat "$DIR/initdb.log" >&2
      die "initdb failed."
    }
  fi
  log "starting PostgreSQL ($("$BIN/postgres" --version)) on 127.0.0.1:$PORT"
  as_owner "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 start -o \
    "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" \
    >&2 || {
    tail -n 30 "$DIR/server.log" >&2 || true
    die "the server did not start (port $PORT taken? set VISIONLOOP_PG_PORT)."
  }
fi

if [ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" != 1 ]; then
  psql_admin -c "CREATE ROLE $ROLE LOGIN CREATEDB PASSWORD '$PASSWORD'"
fi
if [ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
  psql_admin -c "CREATE DATABASE $DB OWNER $ROLE"
fi

echo "postgresql+psycopg://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB"
