# DAX and mmap(MAP_SHARED) (TestDAXFull): coherence with the host both ways,
# truncate and unlink of a mapped file from the guest and from the host, a
# second mount in the same boot, and a reboot with live mappings. Boot with
# e2e.mount=0 and e2e.daxpart=PART:
#   coherence   mount dax=always; host write seen in the guest's live mapping
#               (in a whole page, and in the last partial page: a tail);
#               guest store seen by a host read (before and after msync); guest
#               truncate and unlink of a mapped file; host unlink of a mapped
#               file; umount + mount dax=always again and read everything back
#               (the daemon must have forgotten the old mappings at INIT); then
#               a mapping is left live and the guest reboots; the second boot
#               (the host answers "second" to "dax-boot") mounts again and
#               reads every file back.
#   hosttrunc   mount dax=always, map a 4 MiB file and touch both slots, the host
#               truncates it to 4096 bytes, the guest reads below and past the
#               new end (this can end QEMU: the host records how).
# The host made, before the boot: c1 (8192 bytes of 'a'), c2 (5000 of 'b'), t1 and u1 and hu1
# (8192 bytes each), ht1 (4 MiB), and h-SIZE files.
#
# Output: E2E-RESULT mmap.KEY VALUE per check; the host asks are
# E2E-ASK dax-boot, host-write-c1, host-write-c2, host-read-c1-nosync, host-read-c1-sync,
# host-unlink-hu1, host-truncate-ht1.

# map_open FILE: fsops mapsh on FILE in the background, commands through fd 3.
map_open() {
	rm -f /tmp/map.in /tmp/map.out /tmp/map.n
	mkfifo /tmp/map.in
	fsops mapsh "$1" </tmp/map.in >/tmp/map.out 2>&1 &
	map_pid=$!
	exec 3>/tmp/map.in
	echo 0 >/tmp/map.n
	map_wait
}

# map_wait: wait (30 s at most) for fsops mapsh's next line and print it
# (the count of lines read is kept in a file: map_cmd runs in $(...)).
map_wait() {
	map_lines=$(cat /tmp/map.n)
	_i=0
	while [ "$(wc -l </tmp/map.out)" -le "$map_lines" ]; do
		_i=$((_i + 1))
		if [ $_i -gt 300 ]; then
			echo "no-answer"
			return 1
		fi
		if ! kill -0 "$map_pid" 2>/dev/null; then
			usleep 100000
			if [ "$(wc -l </tmp/map.out)" -le "$map_lines" ]; then
				echo "exited"
				return 1
			fi
		fi
		usleep 100000
	done
	map_lines=$((map_lines + 1))
	echo $map_lines >/tmp/map.n
	sed -n "${map_lines}p" /tmp/map.out
}

# map_cmd CMD: one command to fsops mapsh; prints its answer.
map_cmd() {
	echo "$1" >&3
	map_wait
}

map_close() {
	map_cmd q
	exec 3>&-
	wait "$map_pid" 2>/dev/null
}

res() { echo "E2E-RESULT mmap.$1 $2"; }

mount_dax() {
	step "mount-$1" mount -t virtiofs -o dax=always "$E2E_TAG" /mnt
}

read_all() {
	for f in /mnt/h-*; do
		res "$1.${f##*/}" "$(sha256sum <"$f" | cut -d' ' -f1)"
	done
}

coherence() {
	mount_dax 1 || return
	map_open /mnt/c1
	res open "$(sed -n 1p /tmp/map.out)"
	# A host write seen in the guest's live mapping.
	e2e_ask host-write-c1 >/dev/null
	res host-write-seen "$(map_cmd 'p 100 HOSTWROTE 5000')"
	# A guest store seen by a host read: before msync, then after.
	res guest-store "$(map_cmd 'w 200 GUESTSTORE')"
	res host-read-nosync "$(e2e_ask host-read-c1-nosync)"
	res msync "$(map_cmd s)"
	res host-read-sync "$(e2e_ask host-read-c1-sync)"
	map_close

	# A host write into the last partial page of a mapped file (the
	# daemon maps it from a copy, refreshed when inotify reports the write)
	# seen in the guest's live mapping.
	map_open /mnt/c2
	res tail.open "$(sed -n 1p /tmp/map.out)"
	e2e_ask host-write-c2 >/dev/null
	res tail.host-write-seen "$(map_cmd 'p 4200 HOSTTAIL 5000')"
	map_close

	# The guest truncates a file it has mapped: past the new end faults.
	map_open /mnt/t1
	res gtrunc.open "$(sed -n 1p /tmp/map.out)"
	res gtrunc.ftrunc "$(fsops ftrunc /mnt/t1 4096)"
	res gtrunc.read-below "$(map_cmd 'r 0 4')"
	res gtrunc.read-past "$(map_cmd 'r 4096 4')"
	res gtrunc.size "$(stat -c %s /mnt/t1)"
	map_close

	# The guest unlinks a file it has mapped: the mapping stays usable.
	map_open /mnt/u1
	res gunlink.open "$(sed -n 1p /tmp/map.out)"
	res gunlink.rm "$(fsops try unlink /mnt/u1)"
	res gunlink.read "$(map_cmd 'r 0 4')"
	res gunlink.store "$(map_cmd 'w 0 UNLK')"
	res gunlink.reread "$(map_cmd 'r 0 4')"
	map_close

	# The host unlinks a file the guest has mapped.
	map_open /mnt/hu1
	res hunlink.open "$(sed -n 1p /tmp/map.out)"
	e2e_ask host-unlink-hu1 >/dev/null
	res hunlink.read "$(map_cmd 'r 0 4')"
	res hunlink.stat "$(fsops try open /mnt/hu1)"
	map_close

	read_all mount1
	res c1.mount1 "$(dd if=/mnt/c1 bs=1 skip=100 count=9 2>/dev/null)"
	step umount-1 umount /mnt
	# A second mount in the same boot: QEMU still holds the first mount's
	# mappings unless the daemon dropped them at INIT.
	mount_dax 2 || return
	read_all mount2
	res c1.mount2 "$(dd if=/mnt/c1 bs=1 skip=200 count=10 2>/dev/null)"

	# Reboot with a live mapping (every page of c1 and of the largest h-file touched).
	big=$(ls -S /mnt/h-* | head -n1)
	rm -f /tmp/hold.in /tmp/hold.out
	mkfifo /tmp/hold.in
	fsops mapsh "$big" </tmp/hold.in >/tmp/hold.out 2>&1 &
	exec 4>/tmp/hold.in
	_i=0
	while [ ! -s /tmp/hold.out ] && [ $_i -lt 600 ]; do
		usleep 100000
		_i=$((_i + 1))
	done
	res reboot.hold "$(head -n1 /tmp/hold.out)"
	map_open /mnt/c1
	res reboot.open "$(sed -n 1p /tmp/map.out)"
	e2e_final reboot
}

after_reboot() {
	mount_dax 3 || return
	read_all mount3
	res c1.mount3 "$(dd if=/mnt/c1 bs=1 skip=100 count=9 2>/dev/null)"
}

hosttrunc() {
	mount_dax 1 || return
	map_open /mnt/ht1
	res htrunc.open "$(sed -n 1p /tmp/map.out)"
	res htrunc.read-slot1 "$(map_cmd 'r 2097152 4')"
	e2e_ask host-truncate-ht1 >/dev/null
	res htrunc.read-below "$(map_cmd 'r 0 4')"
	res htrunc.read-past-page "$(map_cmd 'r 8192 4')"
	res htrunc.read-past-slot "$(map_cmd 'r 2097152 4')"
	res htrunc.store-past "$(map_cmd 'w 8192 X')"
	map_close
	res htrunc.size "$(stat -c %s /mnt/ht1)"
	read_all after-htrunc
}

case ${E2E_DAXPART:-coherence} in
hosttrunc) hosttrunc ;;
*)
	case $(e2e_ask dax-boot) in
	second) after_reboot ;;
	*) coherence ;;
	esac
	;;
esac
