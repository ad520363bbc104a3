# DAX rows of make bench-guest (TestBenchGuestDAX): the same workloads with
# and without DAX, each after the guest dropped its caches. Boot with
# e2e.mount=0; e2e.benchmount=always mounts with -o dax=always, anything else
# without a dax option. The host made, and read once (host-cached):
#   /mnt/half   half the window (e2e.benchhalf bytes)
#   /mnt/big    four times the window
# Workloads (fio, psync, buffered: the guest's page cache is what DAX avoids):
#   seqread-read, seqread2-read   sequential 1 MiB reads of half, twice
#   randread-read                 4 KiB random reads of half (time based)
#   mmaprand-read                 4 KiB random reads of half through mmap (fio mmap engine)
#   seqwrite-write                a sequential 1 MiB write of a new file of half's size, fsync at the end
#   bigread-read                  sequential 1 MiB reads of big
# Output per workload: "E2E-FIO NAME <terse v3>" and
# "E2E-CACHED NAME BEFORE AFTER" (/proc/meminfo Cached, KiB, before the
# workload after the drop and after it; seqread2 does not drop, so
# seqread's BEFORE to seqread2's AFTER is the growth of reading half twice).
rt=${E2E_BENCHRUNTIME:-5}
opt=
[ "${E2E_BENCHMOUNT:-none}" = always ] && opt="-o dax=always"
# shellcheck disable=SC2086
step mount mount -t virtiofs $opt "$E2E_TAG" /mnt || exit 1
grep ' /mnt ' /proc/mounts

cached() { awk '/^Cached:/ { print $2 }' /proc/meminfo; }
drop() {
	sync
	echo 3 >/proc/sys/vm/drop_caches
}

# bd NAME DROP FIO-ARGS...
bd() {
	_n=$1
	_drop=$2
	shift 2
	[ "$_drop" = 1 ] && drop
	_b=$(cached)
	fio --name="$_n" --output-format=terse --terse-version=3 "$@" >/tmp/fio.out 2>/tmp/fio.err
	_rc=$?
	_a=$(cached)
	sed "s/^/E2E-FIO $_n /" /tmp/fio.out
	cat /tmp/fio.err
	echo "E2E-CACHED $_n $_b $_a"
	return $_rc
}

step bench-seqread bd seqread-read 1 --filename=/mnt/half --rw=read --bs=1m --ioengine=psync
step bench-seqread2 bd seqread2-read 0 --filename=/mnt/half --rw=read --bs=1m --ioengine=psync
step bench-randread bd randread-read 1 --filename=/mnt/half --rw=randread --bs=4k --ioengine=psync \
	--time_based --runtime="$rt"
step bench-mmaprand bd mmaprand-read 1 --filename=/mnt/half --rw=randread --bs=4k --ioengine=mmap \
	--time_based --runtime="$rt"
step bench-seqwrite bd seqwrite-write 1 --filename=/mnt/written --rw=write --bs=1m --ioengine=psync \
	--size="$(stat -c %s /mnt/half)" --end_fsync=1
rm -f /mnt/written
step bench-bigread bd bigread-read 1 --filename=/mnt/big --rw=read --bs=1m --ioengine=psync
