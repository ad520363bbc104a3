# fio throughput runs driven by the host (make bench-guest, TestBenchGuest):
# the guest asks "bench-next" and runs the workload the host answers, until
# the answer is "done" (or empty: the ask timed out). Several guests boot at
# once and the host runs one workload at a time, on each guest in turn.
# Sourced by /init (step and e2e_ask come from there).
#
# An answer is "NAME RW BS IODEPTH NUMJOBS", "NAME files OP COUNT 0" for
# a timed metadata phase (files_run), or "NAME walk OP FILES DIR" for a walk
# of the host-made tree /mnt/DIR (walk-lib.sh's walk_op, after walk_drop:
# every walk starts cold; output its E2E-WALK line). Every workload uses files
# DIR/bench.N (one per job), libaio, O_DIRECT, time_based, group_reporting,
# no verify; the files stay between workloads (reads read what earlier
# writes left; fio lays out missing ones first, outside the measurement).
#
# Kernel parameters:
#   e2e.benchsize=SIZE     file size per job (default 64M)
#   e2e.benchruntime=SECS  seconds per workload (default 5)
#   e2e.asktimeout=SECS    (guest-init.sh) how long to wait for the next one
#
# Output: step "bench-NAME" with one line "E2E-FIO NAME <fio terse v3 line>".
. /e2e/scripts/walk-lib.sh
_dir=/mnt/bench
mkdir -p $_dir

bench_run() {
	_bn=$1
	fio --name="$_bn" --directory=$_dir --filename_format='bench.$jobnum' \
		--size="${E2E_BENCHSIZE:-64M}" --rw="$2" --bs="$3" --iodepth="$4" --numjobs="$5" \
		--group_reporting --ioengine=libaio --direct=1 \
		--time_based --runtime="${E2E_BENCHRUNTIME:-5}" \
		--output-format=terse --terse-version=3 >/tmp/fio.out 2>/tmp/fio.err
	_rc=$?
	sed "s/^/E2E-FIO $_bn /" /tmp/fio.out
	cat /tmp/fio.err
	return $_rc
}

# uptime_cs prints the time since boot in centiseconds (busybox's date has
# no %N; 10 ms is fine beside operations on 1,500 files under TCG).
uptime_cs() {
	read -r _up _ </proc/uptime
	echo "${_up%.*}${_up#*.}"
}

# files_run NAME OP COUNT: one metadata phase over a directory of COUNT
# files, each phase one process with every name as an argument (so the
# guest's fork and exec do not dominate): create (touch), ls (ls -l), stat
# (stat of every file), unlink (rm of every file). Output:
# "E2E-TIME NAME CENTISECONDS".
files_run() {
	_fd=$_dir/files
	if [ "$2" = create ]; then
		rm -rf $_fd
		mkdir -p $_fd
		seq "$3" | sed "s|^|$_fd/f|" >/tmp/files.list
	fi
	_names=$(cat /tmp/files.list)
	_t0=$(uptime_cs)
	case $2 in
	create) touch $_names || return 1 ;;
	ls) ls -l $_fd >/dev/null || return 1 ;;
	stat) stat $_names >/dev/null || return 1 ;;
	unlink) rm $_names || return 1 ;;
	esac
	echo "E2E-TIME $1 $(($(uptime_cs) - _t0))"
}

while :; do
	_w=$(e2e_ask bench-next)
	case $_w in '' | done) break ;; esac
	# shellcheck disable=SC2086
	set -- $_w
	case $2 in
	files) step "bench-$1" files_run "$1" "$3" "$4" ;;
	walk)
		walk_drop
		step "bench-$1" walk_op "$3" "/mnt/$5"
		;;
	*) step "bench-$1" bench_run "$@" ;;
	esac
done
step bench-rm rm -rf $_dir
