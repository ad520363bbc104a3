# Live migration under load (TestMigration). The guest keeps files open on
# fds across one or more migrations while fio and an appender run, asks the
# host to migrate (E2E-ASK migrate-N), and checks afterwards that every fd
# still works, that no appended line was lost or doubled, and that every fio
# pass verified. After the first migration it creates no file on the share
# (the node-id check of TestMigration relies on that).
#
# Kernel parameters:
#   e2e.migcount=N      migrations to ask for (default 1)
#   e2e.migfiosize=S    fio's file size per pass (default 8M)
#   e2e.migunlinked=1   also hold mig/unlinked.txt open on fd 5 (the host
#                       unlinks it before migrating) and report reading it
#   e2e.migreboot=1     after the checks, reboot (on the destination) and
#                       check the share's files again on the next boot
#
# The host's answer: "STATUS [append=NAME] [read=NAME]" with STATUS the
# migration's end (completed, failed, cancelled); NAME: where the host
# renamed mig/append.txt or mig/read.txt meanwhile.
#
# Files (share/mig/): read.txt (written by the guest, then read through fd 3
# one 4 KiB block per phase), append.txt (fd 4, O_APPEND: "line N"),
# fio.dat (fio passes in a loop), unlinked.txt (fd 5).
#
# Markers:
#   E2E-MIG-FIO pass=N rc=R phase=P endphase=Q uptime=U   one fio pass
#       (write + crc32c verify), begun after P answers and ended after Q
#   E2E-MIG-ANSWER n=N status=S words=W
#   E2E-MIG-CHECK NAME ok|fail DETAIL       one check (the steps say more)
#   E2E-MIG-UNLINKED rc=R out=OUT           reading fd 5 after the last answer
#   E2E-MIG-END appended=N fio_passes=P fio_failed=F failed=C
MIGCOUNT=${E2E_MIGCOUNT:-1}
FIOSIZE=${E2E_MIGFIOSIZE:-8M}
M=/mnt/mig

mig_fail=0
check() { # check NAME ok|fail DETAIL
	echo "E2E-MIG-CHECK $*"
	[ "$2" = ok ] || mig_fail=$((mig_fail + 1))
}

# The files' expected content: read.txt is 20000 numbered lines (~108 KiB).
seq 1 20000 >/tmp/read.exp

# check_lines FILE N: FILE holds exactly "line 1" .. "line N".
check_lines() {
	awk -v n="$2" '
		$0 != "line " NR { if (bad++ < 5) print "line " NR ": [" $0 "]" }
		END { if (NR != n) { print "lines " NR ", want " n; exit 1 } if (bad) { print bad " bad lines"; exit 1 } }' "$1"
}

# After a reboot on the destination: the share's files as the first boot
# left them.
if [ -s $M/reboot-pending ]; then
	step reboot-read cmp /tmp/read.exp $M/read.txt && check reboot-read ok || check reboot-read fail
	n=$(cat $M/append.count)
	out=$(check_lines $M/append.txt "$n") && check reboot-append ok "lines=$n" || check reboot-append fail "$out"
	rm -f $M/reboot-pending $M/append.count
	echo "E2E-MIG-END rebooted=1 failed=$mig_fail"
	return 0 2>/dev/null || exit 0
fi

# read_block K: reads the next 4 KiB through fd 3 and compares it with
# block K of the expected content.
read_block() {
	dd bs=4096 count=1 <&3 >/tmp/got.$1 2>/tmp/dd.err || { cat /tmp/dd.err; return 1; }
	dd if=/tmp/read.exp bs=4096 skip="$1" count=1 2>/dev/null >/tmp/want.$1
	cmp /tmp/want.$1 /tmp/got.$1
}

step mig-setup sh -c "mkdir -p $M && cp /tmp/read.exp $M/read.txt && : >$M/append.txt && sync" ||
	check setup fail
if [ "$E2E_MIGREBOOT" = 1 ]; then
	# Made now: no file is created after the first migration.
	: >$M/append.count
	: >$M/reboot-pending
fi
seq 100001 101000 >/tmp/unlinked.exp
if [ "$E2E_MIGUNLINKED" = 1 ]; then
	cp /tmp/unlinked.exp $M/unlinked.txt
	exec 5<$M/unlinked.txt
fi
exec 3<$M/read.txt
exec 4>>$M/append.txt
step read-0 read_block 0 && check read-0 ok || check read-0 fail

echo 0 >/tmp/phase
# The appender: one line per write(2) through fd 4 until told to stop.
(
	i=0
	while [ ! -e /tmp/stop-append ]; do
		if ! echo "line $((i + 1))" >&4; then
			echo "E2E-MIG-CHECK append-write fail line=$((i + 1)) phase=$(cat /tmp/phase)"
			break
		fi
		i=$((i + 1))
		echo $i >/tmp/appended
		usleep 2000
	done
) &
app_pid=$!
# fio: write + crc32c verify passes of one file, back to back, until told
# to stop; the pass running at a switch-over writes on one side and
# verifies on the other.
(
	n=0
	while [ ! -e /tmp/stop-fio ]; do
		n=$((n + 1))
		ph=$(cat /tmp/phase)
		fio --name=mig --filename=$M/fio.dat --size="$FIOSIZE" --bs=128k --rw=write --direct=1 \
			--ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 >/tmp/fio.$n.log 2>&1
		rc=$?
		echo "E2E-MIG-FIO pass=$n rc=$rc phase=$ph endphase=$(cat /tmp/phase) uptime=$(uptime_s)"
		[ $rc = 0 ] || tail -n 20 /tmp/fio.$n.log
		echo $rc >/tmp/fio.$n.rc
	done
) &
fio_pid=$!

# Ask once both are under way: 20 lines appended and fio's first pass over.
for _ in $(seq 600); do
	[ -e /tmp/fio.1.rc ] && [ "$(cat /tmp/appended 2>/dev/null)" -ge 20 ] 2>/dev/null && break
	usleep 100000
done
appendpath=$M/append.txt
m=1
while [ $m -le "$MIGCOUNT" ]; do
	ans=$(e2e_ask migrate-$m)
	echo $m >/tmp/phase
	set -- $ans
	status=${1:-none}
	shift 2>/dev/null
	for w in "$@"; do
		case $w in
		append=*) appendpath=$M/${w#append=} ;;
		esac
	done
	echo "E2E-MIG-ANSWER n=$m status=$status words=$*"
	# One more block through the fd that stayed open.
	step read-$m read_block $m && check read-$m ok "status=$status" || check read-$m fail "status=$status"
	m=$((m + 1))
done

# Let fio run one whole pass after the last answer, then stop both.
last=$(ls /tmp/fio.*.log | wc -l)
for _ in $(seq 1200); do
	[ -e /tmp/fio.$((last + 1)).rc ] && break
	usleep 100000
done
touch /tmp/stop-fio /tmp/stop-append
wait $fio_pid
wait $app_pid
n=$(cat /tmp/appended)

# The fds still work: one more block, 100 more lines.
step read-final read_block $((MIGCOUNT + 1)) && check read-final ok || check read-final fail
step append-more sh -c "for i in \$(seq $((n + 1)) $((n + 100))); do echo \"line \$i\" >&4 || exit 1; done" &&
	check append-more ok || check append-more fail
n=$((n + 100))
if [ "$E2E_MIGUNLINKED" = 1 ]; then
	out=$(dd bs=4096 count=1 <&5 2>&1 >/tmp/unlinked.got)
	rc=$?
	if [ $rc = 0 ]; then
		dd if=/tmp/unlinked.exp bs=4096 count=1 2>/dev/null | cmp -s - /tmp/unlinked.got && out=content-ok || out=content-differs
	fi
	echo "E2E-MIG-UNLINKED rc=$rc out=$(echo $out | tr ' ' _)"
	exec 5<&-
fi
exec 3<&- 4>&-
# Nothing lost, nothing doubled, in order.
out=$(check_lines "$appendpath" "$n")
if [ $? = 0 ]; then
	check append-check ok "lines=$n"
else
	check append-check fail "lines=$n"
	echo "$out"
fi
passes=0 failed=0
for f in /tmp/fio.*.rc; do
	passes=$((passes + 1))
	[ "$(cat "$f")" = 0 ] || failed=$((failed + 1))
done
[ $failed = 0 ] && [ $passes -ge 2 ] && check fio ok "passes=$passes" || check fio fail "passes=$passes failed=$failed"
echo "E2E-MIG-END appended=$n fio_passes=$passes fio_failed=$failed failed=$mig_fail"
if [ "$E2E_MIGREBOOT" = 1 ]; then
	echo $n >$M/append.count
	[ "$appendpath" = $M/append.txt ] || mv "$appendpath" $M/append.txt
	echo 1 >$M/reboot-pending
	e2e_final reboot
fi
