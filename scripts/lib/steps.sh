# steps.sh: timed steps for scripts/test.sh, sourced (not run).
#
#   step  NAME CMD [ARG...]   run CMD now; its output goes straight through
#   spawn NAME CMD [ARG...]   start CMD in the background, output to a log
#   join  NAME                wait for a spawned step, then print its log
#   step_pid NAME             the PID of a spawned step still unjoined
#                             (nothing if there is none)
#   steps_table               the table of every step so far (also printed
#                             at exit, pass or fail, by steps_init's trap)
#
# CMD runs in a subshell with `set -e` in force (a function as the body
# keeps errexit, unlike `f || rc=$?`). A step that fails ends the run: the
# other spawned steps are stopped, the table printed, the exit status 1.
# The table has each step's start (minutes into the run), wall time and
# CPU time (user + system of everything it ran and waited for): a step
# whose CPU time is far below twice its wall time on this 2-core machine
# is waiting, not computing.

STEPS_T0=$(date +%s)
STEPS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvmove-steps.XXXXXX")
STEPS_CLK=$(getconf CLK_TCK 2>/dev/null || echo 100)
STEPS_ORDER=()
declare -A STEPS_PID=()

steps_init() {
  trap 'steps_exit' EXIT
  trap 'exit 130' INT TERM
}

# The file name of a step's records.
_steps_key() { printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_'; }

# Inside a step's subshell, at its exit: end time, CPU seconds, status.
_steps_done() {
  local rc=$1 key=$2 st
  read -r -a st < "/proc/$BASHPID/stat" || st=()
  local ticks=$(( ${st[13]:-0} + ${st[14]:-0} + ${st[15]:-0} + ${st[16]:-0} ))
  printf '%s %s %s\n' "$(date +%s)" "$(( ticks / STEPS_CLK ))" "$rc" > "$STEPS_DIR/$key.end"
}

_steps_body() {
  local key=$1; shift
  trap '_steps_done $? '"$key" EXIT
  set -e
  "$@"
}

_steps_banner() {
  printf '\n==> %s   [%s into the run; disk: %s free]\n' "$1" "$(_steps_mmss $(( $(date +%s) - STEPS_T0 )))" \
    "$(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ')"
}

_steps_mmss() { printf '%d:%02d' $(( $1 / 60 )) $(( $1 % 60 )); }

_steps_start() {
  local name=$1 key
  key=$(_steps_key "$name")
  date +%s > "$STEPS_DIR/$key.start"
  printf '%s' "$key"
}

step() {
  local name=$1; shift
  local key rc=0
  key=$(_steps_start "$name")
  STEPS_ORDER+=("$name")
  _steps_banner "$name"
  ( _steps_body "$key" "$@" ) &
  wait $! || rc=$?
  if [ "$rc" != 0 ]; then
    echo "STEP FAILED: $name (exit $rc)" >&2
    exit 1
  fi
}

spawn() {
  local name=$1; shift
  local key
  key=$(_steps_start "$name")
  STEPS_ORDER+=("$name")
  printf '\n==> started in the background: %s   [%s into the run]\n' "$name" "$(_steps_mmss $(( $(date +%s) - STEPS_T0 )))"
  ( _steps_body "$key" "$@" ) > "$STEPS_DIR/$key.log" 2>&1 < /dev/null &
  STEPS_PID[$key]=$!
}

step_pid() {
  local key
  key=$(_steps_key "$1")
  printf '%s' "${STEPS_PID[$key]:-}"
}

join() {
  local name=$1 key rc=0
  key=$(_steps_key "$name")
  local pid=${STEPS_PID[$key]:-}
  [ -n "$pid" ] || { echo "steps: join of a step never spawned: $name" >&2; exit 1; }
  wait "$pid" || rc=$?
  unset "STEPS_PID[$key]"
  _steps_banner "$name (ran in the background; its output follows)"
  cat "$STEPS_DIR/$key.log"
  if [ "$rc" != 0 ]; then
    _steps_reasons "$STEPS_DIR/$key.log" >&2
    echo "STEP FAILED: $name (exit $rc)" >&2
    exit 1
  fi
}

# A failed step's reasons, from its log, for the end of the run (where a
# reader of only the last lines looks): every libtest failure's message
# (the "---- NAME stdout ----" blocks of libtest, "---- NAME ----" of the
# conformance suite (libtest-mimic), 25 lines each, 6 at most) and the
# lines that say FAILED. The log's end alone showed the VM's last suite,
# not the case that failed minutes before it (the CI run of 097cd60).
_steps_reasons() {
  local log=$1
  [ -s "$log" ] || return 0
  echo "---- why it failed (from its log):"
  awk '
    /^---- .+ ----$/ { if (blocks < 6) { inblk = 1; n = 0; blocks++; print; next } }
    inblk && /^(failures:|test result:)/ { inblk = 0 }
    inblk { if (n++ < 25) print; next }
    /FAILED|^error(\[|:)/ && said < 20 { print; said++ }
  ' "$log"
}

# Stops a process and everything under it.
_steps_kill_tree() {
  local p=$1 c
  for c in $(pgrep -P "$p" 2>/dev/null); do _steps_kill_tree "$c"; done
  kill -TERM "$p" 2>/dev/null || true
}

steps_table() {
  local name key s e cpu rc wall status now
  now=$(date +%s)
  echo
  echo "==> step times (wall and CPU; this machine has $(nproc 2>/dev/null || echo '?') cores)"
  printf '%-58s %7s %7s %7s  %s\n' step start wall cpu result
  for name in "${STEPS_ORDER[@]}"; do
    key=$(_steps_key "$name")
    [ -e "$STEPS_DIR/$key.start" ] || continue
    s=$(cat "$STEPS_DIR/$key.start")
    if [ -s "$STEPS_DIR/$key.end" ]; then
      read -r e cpu rc < "$STEPS_DIR/$key.end"
      case $rc in
        0) status=ok ;;
        stopped) status="stopped (another step failed)" ;;
        *) status="FAILED (exit $rc)" ;;
      esac
    else
      e=$now cpu=- status="not finished"
    fi
    wall=$(( e - s ))
    [ "$cpu" = - ] || cpu=$(_steps_mmss "$cpu")
    printf '%-58.58s %7s %7s %7s  %s\n' "$name" "$(_steps_mmss $(( s - STEPS_T0 )))" "$(_steps_mmss "$wall")" "$cpu" "$status"
  done
  printf '%-58s %7s %7s\n' "total" "" "$(_steps_mmss $(( now - STEPS_T0 )))"
}

steps_exit() {
  local rc=$? key rc_bg
  trap - EXIT
  for key in "${!STEPS_PID[@]}"; do
    # A step that had already ended keeps its own status (a failure not
    # yet joined shows as FAILED); one still running is stopped.
    if [ -s "$STEPS_DIR/$key.end" ]; then
      echo "steps: the background step $key ended and was not joined yet" >&2
    else
      echo "steps: stopping the background step $key (the run is ending)" >&2
      _steps_kill_tree "${STEPS_PID[$key]}"
      wait "${STEPS_PID[$key]}" 2>/dev/null || true
      printf '%s - stopped\n' "$(date +%s)" > "$STEPS_DIR/$key.end"
    fi
    echo "---- its output (the end):" >&2
    tail -n 40 "$STEPS_DIR/$key.log" >&2 || true
    read -r _ _ rc_bg < "$STEPS_DIR/$key.end" || rc_bg=0
    case $rc_bg in 0|stopped) ;; *) _steps_reasons "$STEPS_DIR/$key.log" >&2 ;; esac
  done
  steps_table
  rm -rf "$STEPS_DIR"
  exit "$rc"
}
