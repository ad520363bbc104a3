# fio from several jobs at once on a share with several request queues
# (TestMultiqueueFio). Linux >= 6.11 sends each request on the queue of the
# CPU that submits it, so jobs running on both vCPUs use both request queues.
# For each job a write pass (verify=crc32c headers written), then a read pass
# over the same files that verifies every block (verify_fatal). Each job has
# its own file (DIR/JOB.N), libaio, O_DIRECT, group_reporting: one terse line
# per pass. Sourced by /init (step comes from there).
#
# Kernel parameters:
#   e2e.mqjobs=N        fio numjobs (default 4)
#   e2e.mqdepth=N       libaio iodepth per job (default 4)
#   e2e.mqseqsize=SIZE  file size per job of the 1 MiB sequential job (default 8M)
#   e2e.mqrandsize=SIZE file size per job of the 4 KiB random job (default 2M)
#
# Output: step "fio-JOB-write" / "fio-JOB-read" with one line
# "E2E-FIO JOB-write|JOB-read <fio terse v3 line>"; "E2E-IRQ WHEN <line of
# /proc/interrupts>" for each virtio interrupt, before and after the passes
# (per-queue completion interrupts: requests.0, requests.1, ...).
_dir=/mnt/mq
mkdir -p $_dir

mq_irqs() {
	grep virtio /proc/interrupts | sed "s/^/E2E-IRQ $1 /"
}

# mq_pass JOB PASS ARGS...: PASS is write or read
mq_pass() {
	_job=$1 _pass=$2
	shift 2
	fio --name="$_job" --directory=$_dir --filename_format="$_job.\$jobnum" \
		--numjobs="${E2E_MQJOBS:-4}" --group_reporting \
		--ioengine=libaio --iodepth="${E2E_MQDEPTH:-4}" --direct=1 \
		--verify=crc32c --verify_fatal=1 \
		--output-format=terse --terse-version=3 "$@" >/tmp/fio.out 2>/tmp/fio.err
	_rc=$?
	sed "s/^/E2E-FIO $_job-$_pass /" /tmp/fio.out
	cat /tmp/fio.err
	return $_rc
}

# mq_job NAME RW BS SIZE: RW is seq or rand
mq_job() {
	case $2 in
	seq) _w=write _r=read ;;
	*) _w=randwrite _r=randread ;;
	esac
	step "fio-$1-write" mq_pass "$1" write --rw="$_w" --bs="$3" --size="$4" --do_verify=0
	step "fio-$1-read" mq_pass "$1" read --rw="$_r" --bs="$3" --size="$4"
}

mq_irqs before
mq_job mq-seq-1m seq 1m "${E2E_MQSEQSIZE:-8M}"
mq_job mq-rand-4k rand 4k "${E2E_MQRANDSIZE:-2M}"
mq_irqs after
step mq-rm rm -rf $_dir
