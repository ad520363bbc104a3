# DAX (TestDAX, TestDAXFull): files of every size read and written through the
# shared-memory window, once per mount mode, the mounts one after the other in
# one boot (umount + mount: the daemon must forget the old mappings on INIT).
# Boot with e2e.mount=0: this script mounts.
#
# Kernel parameters:
#   e2e.daxmodes=always,inode   mount modes in order: always, inode, never (-o dax=MODE)
#                               or none (no dax option)
#   e2e.daxsizes=0,1,...        file sizes in bytes (default below)
#   e2e.daxbig=N                replaces the size "big" in the list (default 104857607)
#   e2e.daxfio=1                fio write + verify per size (0: skip)
#
# The host made h-SIZE (random bytes) in the share before the boot. Per mode and
# size the guest prints
#   E2E-RESULT dax.MODE.SIZE.hostread SHA    sha256 of h-SIZE read in the guest
#   E2E-RESULT dax.MODE.SIZE.gen SHA         sha256 of `fsops gen 2 SIZE` (what it wrote)
#   E2E-RESULT dax.MODE.SIZE.guestread SHA   g-MODE-SIZE (written by extending writes with
#                                            `fsops gen 1`, then overwritten in place with
#                                            `fsops gen 2` through dd conv=notrunc) read back
#                                            after a sync and drop_caches
#   E2E-RESULT dax.MODE.SIZE.attr dax=D ...  fsops daxattr of g-MODE-SIZE (STATX_ATTR_DAX)
# and the steps fio-MODE-SIZE (fio write + verify, crc32c on 4 KiB blocks from
# 4096 bytes up, a byte pattern in one block below) and their rc. Before each
# mount it asks "dax-MODE-begin" and after the umount "dax-MODE-end" (the host
# cuts the daemon's log there).
sizes=${E2E_DAXSIZES:-0,1,4095,4096,2097151,2097152,2097153,big}
modes=${E2E_DAXMODES:-always,inode}

step cachelen sh -c 'dmesg | grep -i "virtiofs.*cache len" || echo "no Cache len line"'

dax_size() {
	_mode=$1
	_s=$2
	_k=dax.$_mode.$_s
	_g=/mnt/g-$_mode-$_s
	echo "E2E-RESULT $_k.hostread $(sha256sum </mnt/h-$_s | cut -d' ' -f1)"
	fsops gen 1 "$_s" >"$_g" || echo "E2E-MISMATCH $_k.write gen 1 failed"
	fsops gen 2 "$_s" | dd of="$_g" bs=64k conv=notrunc 2>/dev/null || echo "E2E-MISMATCH $_k.overwrite dd failed"
	echo "E2E-RESULT $_k.gen $(fsops gen 2 "$_s" | sha256sum | cut -d' ' -f1)"
	sync
	echo 3 >/proc/sys/vm/drop_caches
	echo "E2E-RESULT $_k.guestread $(sha256sum <"$_g" | cut -d' ' -f1)"
	echo "E2E-RESULT $_k.attr $(fsops daxattr "$_g")"
}

dax_fio() {
	_f=/mnt/fio-$1-$2
	if [ "$2" -ge 4096 ]; then
		_v="--bs=4k --verify=crc32c"
		[ "$2" -gt 8388608 ] && _v="--bs=1m --verify=crc32c"
	else
		_v="--bs=$2 --verify=pattern --verify_pattern=0x5aa5c33c"
	fi
	# randwrite: fio lays the file out first (extending writes), then
	# overwrites it in random order (writes through the window under DAX).
	# shellcheck disable=SC2086
	fio --name="$1-$2" --filename="$_f" --ioengine=psync --rw=randwrite --size="$2" $_v \
		--do_verify=1 --verify_fatal=1 --output-format=terse --terse-version=3 >/tmp/fio.out 2>/tmp/fio.err
	_rc=$?
	sed "s/^/E2E-FIO $1-$2 /" /tmp/fio.out
	cat /tmp/fio.err
	rm -f "$_f"
	return $_rc
}

for mode in $(echo "$modes" | tr , ' '); do
	e2e_ask "dax-$mode-begin" >/dev/null
	opt=
	[ "$mode" = none ] || opt="-o dax=$mode"
	# shellcheck disable=SC2086
	if ! step "mount-$mode" mount -t virtiofs $opt "$E2E_TAG" /mnt; then
		e2e_ask "dax-$mode-end" >/dev/null
		continue
	fi
	grep ' /mnt ' /proc/mounts
	for s in $(echo "$sizes" | tr , ' '); do
		[ "$s" = big ] && s=${E2E_DAXBIG:-104857607}
		step "files-$mode-$s" dax_size "$mode" "$s"
		if [ "${E2E_DAXFIO:-1}" = 1 ] && [ "$s" -gt 0 ]; then
			step "fio-$mode-$s" dax_fio "$mode" "$s"
		fi
	done
	step "umount-$mode" umount /mnt
	e2e_ask "dax-$mode-end" >/dev/null
done
