# Soak (TestSoak, make soak): iterations of fio write + verify and metadata
# churn on the share until e2e.soaksecs seconds of guest uptime have passed
# since the script started; the iteration running at the deadline finishes.
# Sourced by /init (step and e2e_ask come from there).
#
# Each iteration N:
#   step soak-fio-N    one fio job of the four below in turn (N mod 4):
#                      seq-1m-direct, rand-4k-buffered, seq-1m-buffered,
#                      rand-4k-direct; e2e.soakjobs files, one job each, psync,
#                      rw=write|randwrite with verify=crc32c: fio writes
#                      every block, then reads it back and verifies it
#                      (verify_fatal); prints "E2E-FIO soak-JOB <terse v3>";
#                      the files are then removed
#   step soak-churn-N  fsops churn: creates, renames, links, symlinks, lists,
#                      reads back and removes e2e.soakfiles files in their
#                      own directory tree (guest-tools/fsops.c, do_churn)
#   then drops the guest's caches (the kernel FORGETs every inode it no
#   longer needs), prints the iteration marker and asks the host to sample
#   the idle daemon:
#     E2E-SOAK iter=N job=JOB fio_rc=R churn_rc=R files=F renamed=.. linked=..
#       symlinked=.. verified=.. unlinked=.. dirs=.. churn_ms=.. uptime=U
#     E2E-ASK soak-idle-N       (the host answers "sampled-N")
# and at the end
#   E2E-SOAK-END iterations=N rc=R
# The first failure (fio error or verify mismatch, churn error, a wrong or
# missing answer) ends the loop; the script's status is then 1.
#
# Kernel parameters:
#   e2e.soaksecs=S       how long to keep starting iterations (default 60)
#   e2e.soakjobs=N       fio jobs (files) per pass (default 2)
#   e2e.soakseqsize=SIZE file size per job of the 1 MiB jobs (default 32M)
#   e2e.soakrandsize=SIZE file size per job of the 4 KiB jobs (default 8M)
#   e2e.soakfiles=N      files per churn round (default 2000)
_dir=/mnt/soak
_end=$(($(cut -d. -f1 /proc/uptime) + ${E2E_SOAKSECS:-60}))
_jobs=${E2E_SOAKJOBS:-2}
_files=${E2E_SOAKFILES:-2000}

# soak_fio NAME RW BS DIRECT SIZE: one job section per file (numjobs with
# verify makes fio warn about writers sharing blocks even when each job has
# a file of its own), one group: one terse line.
soak_fio() {
	_sections=
	_j=0
	while [ $_j -lt "$_jobs" ]; do
		_sections="$_sections --name=soak-$1 --filename=$1.$_j"
		_j=$((_j + 1))
	done
	# shellcheck disable=SC2086 # _sections is a list of words
	fio --directory=$_dir/fio --group_reporting --ioengine=psync \
		--rw="$2" --bs="$3" --direct="$4" --size="$5" \
		--verify=crc32c --verify_fatal=1 \
		--output-format=terse --terse-version=3 $_sections >/tmp/fio.out 2>/tmp/fio.err
	_frc=$?
	sed "s/^/E2E-FIO soak-$1 /" /tmp/fio.out
	cat /tmp/fio.err
	rm -f $_dir/fio/*
	return $_frc
}

mkdir -p $_dir/fio || exit 1
_i=0
_rc=0
while [ "$(cut -d. -f1 /proc/uptime)" -lt "$_end" ]; do
	_i=$((_i + 1))
	case $((_i % 4)) in
	1) _job=seq-1m-direct _args="write 1m 1 ${E2E_SOAKSEQSIZE:-32M}" ;;
	2) _job=rand-4k-buffered _args="randwrite 4k 0 ${E2E_SOAKRANDSIZE:-8M}" ;;
	3) _job=seq-1m-buffered _args="write 1m 0 ${E2E_SOAKSEQSIZE:-32M}" ;;
	0) _job=rand-4k-direct _args="randwrite 4k 1 ${E2E_SOAKRANDSIZE:-8M}" ;;
	esac
	# shellcheck disable=SC2086 # _args is four words
	step "soak-fio-$_i" soak_fio $_job $_args
	_fio_rc=$?
	step "soak-churn-$_i" sh -c 'fsops churn "$1" "$2" "$3" >/tmp/churn.out; r=$?; cat /tmp/churn.out; exit $r' \
		churn $_dir/churn "$_files" "$_i"
	_churn_rc=$?
	sync
	echo 3 >/proc/sys/vm/drop_caches
	_counts=$(grep -v churn-error /tmp/churn.out | tail -n1)
	echo "E2E-SOAK iter=$_i job=$_job fio_rc=$_fio_rc churn_rc=$_churn_rc ${_counts%% ms=*} churn_ms=${_counts##* ms=} uptime=$(uptime_s)"
	if [ $_fio_rc != 0 ] || [ $_churn_rc != 0 ]; then
		_rc=1
		break
	fi
	_ans=$(e2e_ask "soak-idle-$_i")
	if [ "$_ans" != "sampled-$_i" ]; then
		echo "soak: host answered '$_ans' to soak-idle-$_i"
		_rc=1
		break
	fi
done
echo "E2E-SOAK-END iterations=$_i rc=$_rc"
rmdir $_dir/fio $_dir
exit $_rc
