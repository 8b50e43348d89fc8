#!/bin/sh
# Turn on etcd's authentication for one elastic-refit job (deploy/etcd-security.md, "A
# user per job"). Run by etcd-auth-job.yaml; safe to run again. It makes sure of
#   - the user root (ROOT_PASSWORD) holding the role root,
#   - the role "$JOB-rw": readwrite on the prefix /elastic-refit/$JOB/ and nothing else,
#   - the user JOB_USER (JOB_PASSWORD) holding that role,
# then runs `etcdctl auth enable` and checks, as JOB_USER, that the job's prefix is
# readable and the level above it is not.
#
# What already exists is left as it is: a user keeps its password unless
# RESET_PASSWORDS=true (members logged in as a user whose password changes lose their
# token: rotate between runs of a job). For a second job on the same etcd, run it with
# that job's JOB, JOB_USER and JOB_PASSWORD.
#
# Shell builtins and etcdctl only: etcd images carry no other tools. etcdctl takes etcd's
# endpoints and TLS files from ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT and
# ETCDCTL_KEY. Passwords travel through stdin and the environment, never the command line.
set -eu

: "${JOB:?JOB (the elastic-refit job name) is not set}"
: "${JOB_USER:?JOB_USER is not set}"
: "${JOB_PASSWORD:?JOB_PASSWORD is not set}"
: "${ROOT_PASSWORD:?ROOT_PASSWORD is not set}"
prefix="/elastic-refit/$JOB/"
role="$JOB-rw"

log() { printf 'etcd-auth: %s\n' "$*" >&2; }

# Every command authenticates as root; until `auth enable`, etcd ignores the credentials
# (etcdctl may warn "authentication is not enabled" on the first run: expected).
export ETCDCTL_USER=root
export ETCDCTL_PASSWORD="$ROOT_PASSWORD"

# A linearizable read: etcd answers and has a quorum. If not, exit: the Job tries again.
if ! etcdctl get --keys-only --limit=1 "$prefix" >/dev/null; then
  log "etcd (${ETCDCTL_ENDPOINTS:-?}) does not answer or has no quorum yet, or root's password is wrong; the Job retries"
  exit 1
fi

ensure_user() {  # NAME PASSWORD
  if etcdctl user get "$1" >/dev/null 2>&1; then
    if [ "${RESET_PASSWORDS:-false}" = true ]; then
      printf '%s\n' "$2" | etcdctl user passwd "$1" --interactive=false >/dev/null
      log "user $1: password set again (RESET_PASSWORDS=true)"
    else
      log "user $1: exists, password left as it is"
    fi
  else
    printf '%s\n' "$2" | etcdctl user add "$1" --interactive=false >/dev/null
    log "user $1: added"
  fi
}

ensure_user root "$ROOT_PASSWORD"
etcdctl user grant-role root root >/dev/null  # etcd ignores a role the user holds already

if ! etcdctl role get "$role" >/dev/null 2>&1; then
  etcdctl role add "$role" >/dev/null
  log "role $role: added"
fi
permissions=$(etcdctl role get "$role")
case "$permissions" in
  # `role get` lists a prefix permission as "(prefix P)", under KV Read and under KV Write.
  *"(prefix $prefix)"*"(prefix $prefix)"*)
    log "role $role: has readwrite on $prefix" ;;
  *)
    etcdctl role grant-permission "$role" --prefix=true readwrite "$prefix" >/dev/null
    log "role $role: granted readwrite on $prefix" ;;
esac

ensure_user "$JOB_USER" "$JOB_PASSWORD"
etcdctl user grant-role "$JOB_USER" "$role" >/dev/null

etcdctl auth enable >/dev/null  # a no-op when enabled already
log "authentication is enabled"

# As the job's user: its prefix reads, the key above it does not.
if ! ETCDCTL_USER="$JOB_USER" ETCDCTL_PASSWORD="$JOB_PASSWORD" \
    etcdctl get --keys-only --limit=1 "$prefix" >/dev/null; then
  log "error: user $JOB_USER cannot read $prefix"
  exit 1
fi
if ETCDCTL_USER="$JOB_USER" ETCDCTL_PASSWORD="$JOB_PASSWORD" \
    etcdctl get --keys-only --limit=1 /elastic-refit/ >/dev/null 2>&1; then
  log "error: user $JOB_USER can read /elastic-refit/, outside $prefix (does it hold another role?)"
  exit 1
fi
log "user $JOB_USER: readwrite on $prefix only; done"
