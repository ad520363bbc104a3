# fio with verify=crc32c on the share: for each job a write pass (fio writes
# crc32c verify headers), then a read pass over the same file that verifies
# every block (verify_fatal). Sourced by /init (step comes from there).
#
# Kernel parameters:
#   e2e.fiomatrix=small (default) | full
#       small: sequential 1 MiB and random 4 KiB, O_DIRECT
#       full:  {sequential, random} x {4k, 1m} x {O_DIRECT, buffered}
#   e2e.fiosize=SIZE    file size per job (default: 1m jobs 64M, 4k jobs 16M for
#                       full; 32M and 8M for small)
#
# Each pass is a step "fio-JOB-write" / "fio-JOB-read" whose output holds one
# line "E2E-FIO JOB-write|JOB-read <fio terse v3 line>".
fio_pass() {
	_job=$1
	shift
	fio --name="$_job" --ioengine=psync --verify=crc32c --verify_fatal=1 \
		--output-format=terse --terse-version=3 "$@" >/tmp/fio.out 2>/tmp/fio.err
	_rc=$?
	sed "s/^/E2E-FIO $_job /" /tmp/fio.out
	cat /tmp/fio.err
	return $_rc
}

# fio_job NAME RW BS DIRECT SIZE: RW is seq or rand
fio_job() {
	_f=/mnt/fio-$1
	case $2 in
	seq) _w=write _r=read ;;
	*) _w=randwrite _r=randread ;;
	esac
	step "fio-$1-write" fio_pass "$1-write" --filename="$_f" --rw="$_w" --bs="$3" --direct="$4" --size="$5" --do_verify=0
	step "fio-$1-read" fio_pass "$1-read" --filename="$_f" --rw="$_r" --bs="$3" --direct="$4" --size="$5"
	rm -f "$_f"
}

case ${E2E_FIOMATRIX:-small} in
full)
	# 4 KiB passes run at 1-3k IOPS under TCG: 16 MiB keeps each under ~15 s
	for rw in seq rand; do
		for bs in 4k 1m; do
			size=64M
			[ $bs = 4k ] && size=16M
			fio_job "$rw-$bs-direct" $rw $bs 1 "${E2E_FIOSIZE:-$size}"
			fio_job "$rw-$bs-buffered" $rw $bs 0 "${E2E_FIOSIZE:-$size}"
		done
	done
	;;
*)
	fio_job seq-1m-direct seq 1m 1 "${E2E_FIOSIZE:-32M}"
	fio_job rand-4k-direct rand 4k 1 "${E2E_FIOSIZE:-8M}"
	;;
esac

# Throughput without verify (the guest computing crc32c under TCG bounds the
# verified passes): sequential 1 MiB, O_DIRECT. e2e.fioperf=0 skips it.
if [ "${E2E_FIOPERF:-1}" = 1 ]; then
	_f=/mnt/fio-perf
	step fio-perf-seq-1m-write fio_pass perf-seq-1m-write --filename=$_f --rw=write --bs=1m --direct=1 \
		--size="${E2E_FIOPERFSIZE:-256M}" --verify=0
	step fio-perf-seq-1m-read fio_pass perf-seq-1m-read --filename=$_f --rw=read --bs=1m --direct=1 \
		--size="${E2E_FIOPERFSIZE:-256M}" --verify=0
	rm -f $_f
fi
