# POSIX behaviour of the share, one named step per area (sourced by /init in a
# subshell; step, e2e_ask, e2e_final come from there). Everything happens under
# /mnt/posix; the host test inspects what is left there afterwards.
#
# Every check is made here in the guest: `expect KEY GOT WANT` prints
#   E2E-RESULT KEY GOT
# and, when GOT differs from WANT, also
#   E2E-MISMATCH KEY got=[GOT] want=[WANT]
# and makes the step fail (E2E-STEP NAME rc=number of mismatches). `note KEY
# VALUE` records a result without a wanted value. The host compares the
# E2E-RESULT lines of two daemons, so values hold nothing that varies from run
# to run (no inode numbers, no current times). `E2E-TIME NAME MS` lines are
# timings for the test log only.
#
# Kernel parameters:
#   e2e.posixmany=N      files the guest creates in $P/many (default 1000)
#   e2e.posixlisting=N   files the host put in /mnt/listing before the boot (default 10000)
#   e2e.posixloop=N      files a shell loop creates and removes (default 200)
P=/mnt/posix
MANY=${E2E_POSIXMANY:-1000}
LISTING=${E2E_POSIXLISTING:-10000}
LOOP=${E2E_POSIXLOOP:-200}
_bad=0

expect() {
	echo "E2E-RESULT $1 $2"
	if [ "$2" != "$3" ]; then
		echo "E2E-MISMATCH $1 got=[$2] want=[$3]"
		_bad=$((_bad + 1))
	fi
}
note() {
	k=$1
	shift
	echo "E2E-RESULT $k $*"
}
# check FUNC: runs a test function; its status is the number of mismatches.
check() {
	_bad=0
	"$@"
	[ $_bad -gt 200 ] && _bad=200
	return $_bad
}
ms() { fsops now; }
timing() { echo "E2E-TIME $1 $(($(ms) - $2))"; }
# flat CMD...: the command's stdout with newlines as '|', and its exit status
# appended as ' rc=N' when not 0.
flat() {
	_o=$("$@" 2>/dev/null)
	_r=$?
	_o=$(printf '%s' "$_o" | tr '\n' '|')
	[ $_r -eq 0 ] && echo "$_o" || echo "$_o rc=$_r"
}
md5() { md5sum "$1" 2>/dev/null | cut -d' ' -f1; }
size() { stat -c %s "$1" 2>/dev/null || echo missing; }
zeros_md5() { head -c "$1" /dev/zero | md5sum | cut -d' ' -f1; }

t_setup() {
	rm -rf "$P"
	# the share root is the host test's 0700 temporary directory: let
	# non-root guest users reach $P (attrs step)
	chmod 0755 /mnt
	mkdir "$P"
	expect setup.dir "$(stat -c %F "$P")" "directory"
}

t_create() {
	printf 'hello\n' >"$P/a"
	expect create.read "$(flat cat "$P/a")" "hello"
	printf 'world\n' >>"$P/a"
	expect create.append "$(flat cat "$P/a")" "hello|world"
	expect create.size "$(size "$P/a")" 12
	# a 1 MiB + 1 byte file written in odd-sized pieces, read back whole and at an offset
	fsops gen 1 1048577 >/tmp/rand1m
	dd if=/tmp/rand1m of="$P/big" bs=7777 2>/dev/null
	expect create.big.md5 "$(md5 "$P/big")" "$(md5 /tmp/rand1m)"
	expect create.big.offset "$(dd if="$P/big" bs=4096 skip=100 count=3 2>/dev/null | md5sum | cut -d' ' -f1)" \
		"$(dd if=/tmp/rand1m bs=4096 skip=100 count=3 2>/dev/null | md5sum | cut -d' ' -f1)"
	# overwrite in the middle without truncating
	printf 'XY' | dd of="$P/a" bs=1 seek=2 conv=notrunc 2>/dev/null
	expect create.overwrite "$(flat cat "$P/a")" "heXYo|world"
}

t_trunc() {
	printf '0123456789abcdef\n' >"$P/t"
	printf 'short\n' >"$P/t" # > is O_TRUNC
	expect otrunc.content "$(flat cat "$P/t")" "short"
	expect otrunc.size "$(size "$P/t")" 6
	: >"$P/t"
	expect otrunc.empty "$(size "$P/t")" 0
}

t_append() {
	printf 'one\n' >"$P/app"
	exec 3>>"$P/app" # O_APPEND
	printf 'ZZ' | dd of="$P/app" bs=1 seek=10 conv=notrunc 2>/dev/null
	printf 'two\n' >&3
	exec 3>&-
	expect oappend.size "$(size "$P/app")" 16
	expect oappend.tail "$(tail -c 4 "$P/app" | tr '\n' '|')" "two|"
	expect oappend.hole "$(dd if="$P/app" bs=1 skip=4 count=6 2>/dev/null | od -An -tx1 | tr -d ' \n')" "000000000000"
}

t_excl() {
	expect oexcl.new "$(fsops excl "$P/ex")" ok
	expect oexcl.again "$(fsops excl "$P/ex")" EEXIST
	ln -s ex "$P/ex-link"
	expect oexcl.symlink "$(fsops excl "$P/ex-link")" EEXIST
	ln -s nowhere "$P/ex-dangling"
	expect oexcl.dangling "$(fsops excl "$P/ex-dangling")" EEXIST
	expect oexcl.dangling.target "$(size "$P/nowhere")" missing
}

t_sparse() {
	printf 'tail' | dd of="$P/sparse" bs=1 seek=10485760 2>/dev/null
	expect sparse.size "$(size "$P/sparse")" 10485764
	blocks=$(stat -c %b "$P/sparse")
	expect sparse.allocated_under_1m "$([ "$blocks" -lt 2048 ] && echo yes || echo "no($blocks)")" yes
	expect sparse.hole_reads_zero "$(dd if="$P/sparse" bs=4096 skip=1000 count=2 2>/dev/null | md5sum | cut -d' ' -f1)" "$(zeros_md5 8192)"
	expect sparse.tail "$(tail -c 4 "$P/sparse")" tail
}

t_truncate() {
	printf 'hello world\n' >"$P/tr"
	truncate -s 5 "$P/tr"
	expect truncate.down.size "$(size "$P/tr")" 5
	expect truncate.down.content "$(cat "$P/tr")" hello
	truncate -s 1048576 "$P/tr"
	expect truncate.up.size "$(size "$P/tr")" 1048576
	expect truncate.up.zeros "$(tail -c 1048571 "$P/tr" | md5sum | cut -d' ' -f1)" "$(zeros_md5 1048571)"
	expect truncate.up.head "$(head -c 5 "$P/tr")" hello
	truncate -s 3 "$P/tr"
	expect truncate.down2.content "$(cat "$P/tr")" hel
	# ftruncate (SETATTR with a file handle)
	expect truncate.fd "$(fsops ftrunc "$P/tr" 2)" ok
	expect truncate.fd.content "$(cat "$P/tr")" he
}

t_rename() {
	mkdir "$P/r1" "$P/r2"
	echo A >"$P/r1/a"
	echo B >"$P/r1/b"
	mv -f "$P/r1/a" "$P/r1/b"
	expect rename.over.content "$(cat "$P/r1/b")" A
	expect rename.over.old "$(size "$P/r1/a")" missing
	mv "$P/r1/b" "$P/r2/c"
	expect rename.acrossdir.content "$(cat "$P/r2/c")" A
	expect rename.acrossdir.old "$(size "$P/r1/b")" missing
	echo X >"$P/r1/x"
	echo Y >"$P/r2/y"
	expect rename.exchange "$(fsops rename2 "$P/r1/x" "$P/r2/y" exchange)" ok
	expect rename.exchange.r1x "$(cat "$P/r1/x")" Y
	expect rename.exchange.r2y "$(cat "$P/r2/y")" X
	expect rename.exchange.missing "$(fsops rename2 "$P/r1/x" "$P/r2/none" exchange)" ENOENT
	expect rename.noreplace.exists "$(fsops rename2 "$P/r1/x" "$P/r2/y" noreplace)" EEXIST
	expect rename.noreplace.kept "$(cat "$P/r2/y")" X
	expect rename.noreplace.new "$(fsops rename2 "$P/r1/x" "$P/r2/z" noreplace)" ok
	expect rename.noreplace.moved "$(cat "$P/r2/z") $(size "$P/r1/x")" "Y missing"
	# directories: into another directory, and over an empty directory
	mkdir "$P/r1/sub" "$P/r2/empty"
	echo S >"$P/r1/sub/s"
	mv "$P/r1/sub" "$P/r2/sub"
	expect rename.dir.content "$(cat "$P/r2/sub/s")" S
	mkdir "$P/r1/d2"
	echo D >"$P/r1/d2/f"
	expect rename.dir.over_empty "$(fsops rename2 "$P/r1/d2" "$P/r2/empty" noreplace)" EEXIST
	mv -T "$P/r1/d2" "$P/r2/empty" 2>/dev/null || mv "$P/r1/d2" "$P/r2/empty"
	expect rename.dir.over_empty.content "$(flat ls "$P/r2/empty")" "f"
	expect rename.dir.nonempty "$(fsops rename2 "$P/r2/sub" "$P/r2/empty" exchange)" ok
	expect rename.dir.exchanged "$(flat ls "$P/r2/sub")" "f"
}

t_hardlink() {
	echo linked >"$P/h"
	ln "$P/h" "$P/h1"
	ln "$P/h" "$P/r2/h2"
	expect link.nlink3 "$(stat -c %h "$P/h")" 3
	expect link.same_inode "$([ "$(stat -c %i "$P/h")" = "$(stat -c %i "$P/r2/h2")" ] && echo yes)" yes
	rm "$P/h1"
	expect link.nlink2 "$(stat -c %h "$P/h")" 2
	expect link.content "$(cat "$P/r2/h2")" linked
	echo more >>"$P/r2/h2"
	expect link.shared_write "$(flat cat "$P/h")" "linked|more"
	expect link.dir "$(ln "$P/r1" "$P/r1link" 2>&1 >/dev/null | grep -c 'not permitted')" 1
}

t_symlink() {
	echo target >"$P/st"
	ln -s st "$P/sl"
	ln -s ../posix/r2 "$P/sldir"
	ln -s /nonexistent/abs "$P/slabs"
	expect symlink.readlink "$(readlink "$P/sl")" st
	expect symlink.type "$(stat -c %F "$P/sl")" "symbolic link"
	expect symlink.follow "$(cat "$P/sl")" target
	expect symlink.dir "$(cat "$P/sldir/c")" A
	expect symlink.abs "$(readlink "$P/slabs")" /nonexistent/abs
	expect symlink.abs.dangling "$(cat "$P/slabs" 2>/dev/null || echo ENOENT)" ENOENT
	expect symlink.size "$(stat -c %s "$P/slabs")" 16
	# a long target (PATH_MAX - 1 is the limit; 1000 bytes is well within)
	long=$(head -c 1000 /dev/zero | tr '\0' 'x')
	ln -s "$long" "$P/sllong"
	expect symlink.long "$(readlink "$P/sllong" | wc -c)" 1001
	# a hard link to the symlink itself (LINK on a symlink inode)
	ln "$P/sl" "$P/sl-hard"
	expect symlink.hardlink "$(stat -c '%F %h' "$P/sl-hard") $(readlink "$P/sl-hard")" "symbolic link 2 st"
	# times of the symlink itself (SETATTR on a symlink inode)
	TZ=UTC touch -h -d '2004-05-06 07:08:09' "$P/sl"
	expect symlink.utimes "$(stat -c %Y "$P/sl") $(stat -c %Y "$P/st" | grep -c '^1083827289$')" "1083827289 0"
}

t_attrs() {
	echo attrs >"$P/m"
	chmod 0640 "$P/m"
	expect chmod.0640 "$(stat -c %a "$P/m")" 640
	chmod 4755 "$P/m"
	expect chmod.4755 "$(stat -c %a "$P/m")" 4755
	chown 1234:5678 "$P/m"
	expect chown.ids "$(stat -c %u:%g "$P/m")" 1234:5678
	# chown clears set-user-ID on a regular file, even for root
	expect chown.kills_suid "$(stat -c %a "$P/m")" 755
	chmod 2750 "$P/m"
	chgrp 4321 "$P/m"
	expect chgrp.kills_sgid_groupexec "$(stat -c %a:%g "$P/m")" 750:4321
	chmod 0644 "$P/m"
	chown -h 2222:3333 "$P/sl"
	expect chown.symlink "$(stat -c %u:%g "$P/sl") $(stat -c %u:%g "$P/st")" "2222:3333 0:0"
	TZ=UTC touch -d '2001-02-03 04:05:06' "$P/m"
	expect utimes.both "$(fsops mtime "$P/m")" "mtime=981173106 atime=981173106"
	TZ=UTC touch -m -d '2002-03-04 05:06:07' "$P/m"
	expect utimes.mtime_only "$(fsops mtime "$P/m")" "mtime=1015218367 atime=981173106"
	TZ=UTC touch -a -d '2003-04-05 06:07:08' "$P/m"
	expect utimes.atime_only "$(fsops mtime "$P/m")" "mtime=1015218367 atime=1049522828"
	# touch without a date: UTIME_NOW (the guest and host clocks agree to a few seconds)
	touch "$P/m"
	expect utimes.now "$(d=$(($(date +%s) - $(stat -c %Y "$P/m"))); [ $d -ge -5 ] && [ $d -le 5 ] && echo recent || echo "off by $d s")" recent
	TZ=UTC touch -d '2002-03-04 05:06:07' "$P/m"
	mkdir "$P/dmode"
	chmod 1777 "$P/dmode"
	expect chmod.dir.sticky "$(stat -c %a "$P/dmode")" 1777
	mkdir "$P/dmode/s1" "$P/dmode/s2"
	expect dir.nlink "$(stat -c %h "$P/dmode")" 4
	# ctime moves on chmod (not compared: a time of this run)
	before=$(stat -c %Z "$P/m")
	sleep 1
	chmod 0600 "$P/m"
	expect chmod.ctime_moves "$([ "$(stat -c %Z "$P/m")" -gt "$before" ] && echo yes)" yes
	# a non-root caller: the guest kernel checks permissions (default_permissions)
	echo secret >"$P/priv"
	chmod 0600 "$P/priv"
	expect perm.nonroot_denied "$(fsops asuser 1000 1000 cat "$P/priv" 2>&1 | grep -c 'Permission denied')" 1
	chmod 0644 "$P/priv"
	expect perm.nonroot_read "$(fsops asuser 1000 1000 cat "$P/priv" 2>&1)" secret
	expect perm.nonroot_write "$(fsops asuser 1000 1000 sh -c "echo x >>$P/priv" 2>&1 | grep -c 'Permission denied')" 1
}

t_killpriv() {
	# a write or truncate by a caller without CAP_FSETID clears set-user-ID,
	# and set-group-ID when group-executable; root's writes keep them
	printf 'k\n' >"$P/kp1"
	chmod 6777 "$P/kp1"
	fsops asuser 1000 1000 sh -c "echo x >>$P/kp1"
	expect killpriv.write "$(stat -c %a "$P/kp1") $(flat cat "$P/kp1")" "777 k|x"
	printf 'k\n' >"$P/kp2"
	chmod 4777 "$P/kp2"
	fsops asuser 1000 1000 truncate -s 1 "$P/kp2"
	expect killpriv.truncate "$(stat -c '%a %s' "$P/kp2")" "777 1"
	printf 'k\n' >"$P/kp3"
	chmod 2767 "$P/kp3" # set-group-ID without group execute: mandatory-locking marker, kept
	fsops asuser 1000 1000 sh -c "echo x >>$P/kp3"
	expect killpriv.sgid_noexec "$(stat -c %a "$P/kp3")" 2767
	printf 'k\n' >"$P/kp4"
	chmod 6755 "$P/kp4"
	echo x >>"$P/kp4"
	expect killpriv.root_keeps "$(stat -c %a "$P/kp4")" 6755
	printf 'k\n' >"$P/kp5"
	chmod 6777 "$P/kp5"
	expect killpriv.ftruncate "$(fsops asuser 1000 1000 fsops ftrunc "$P/kp5" 0) $(stat -c %a "$P/kp5")" "ok 777"
	printf 'k\n' >"$P/kp6"
	chmod 6777 "$P/kp6"
	# open(O_TRUNC): with FUSE_ATOMIC_O_TRUNC the guest passes O_TRUNC in OPEN
	# and asks the daemon to kill the bits only with killpriv_v2
	# (FUSE_OPEN_KILL_SUIDGID), which neither daemon enables by default: a
	# local file system would clear them. Recorded and compared, not judged.
	fsops asuser 1000 1000 sh -c ": >$P/kp6"
	note killpriv.open_trunc "$(stat -c '%a %s' "$P/kp6")"
}

t_creds() {
	# objects a non-root guest user creates belong to it on the host
	mkdir "$P/pub"
	chmod 1777 "$P/pub"
	fsops asuser 1000 1001 sh -c "echo mine >$P/pub/file && mkdir $P/pub/dir && ln -s file $P/pub/sym && mkfifo $P/pub/fifo"
	expect creds.owner "$(stat -c %u:%g "$P/pub/file" "$P/pub/dir" "$P/pub/sym" "$P/pub/fifo" | tr '\n' ' ')" \
		"1000:1001 1000:1001 1000:1001 1000:1001 "
	expect creds.sticky_unlink "$(fsops asuser 1002 1002 fsops try unlink "$P/pub/file")" EPERM
	# a set-group-ID directory passes its group on, and the bit to subdirectories
	mkdir "$P/sg"
	chgrp 5678 "$P/sg"
	chmod 2777 "$P/sg"
	fsops asuser 1000 1001 sh -c "echo x >$P/sg/file && mkdir $P/sg/dir"
	expect creds.setgid_dir "$(stat -c '%u:%g %a' "$P/sg/file" "$P/sg/dir" | tr '\n' ' ')" "1000:5678 644 1000:5678 2755 "
	# the umask applies
	(umask 077 && : >"$P/um-file" && mkdir "$P/um-dir")
	expect creds.umask "$(stat -c %a "$P/um-file" "$P/um-dir" | tr '\n' ' ')" "600 700 "
	# setting times needs ownership unless it is "now" and the caller may write
	: >"$P/pub/rootfile"
	chmod 0666 "$P/pub/rootfile"
	expect creds.utime_now "$(fsops asuser 1000 1000 touch "$P/pub/rootfile" 2>&1 && echo ok)" ok
	expect creds.utime_set "$(fsops asuser 1000 1000 touch -d '2001-01-01 00:00:00' "$P/pub/rootfile" 2>&1 | grep -c 'not permitted')" 1
	expect creds.chmod_other "$(fsops asuser 1000 1000 chmod 0600 "$P/pub/rootfile" 2>&1 | grep -c 'not permitted')" 1
}

t_errors() {
	mkdir "$P/e"
	echo f >"$P/e/file"
	mkdir "$P/e/dir" "$P/e/full"
	: >"$P/e/full/x"
	expect err.mkdir_exists "$(fsops try mkdir "$P/e/dir")" EEXIST
	expect err.mkdir_over_file "$(fsops try mkdir "$P/e/file")" EEXIST
	expect err.rmdir_file "$(fsops try rmdir "$P/e/file")" ENOTDIR
	expect err.rmdir_nonempty "$(fsops try rmdir "$P/e/full")" ENOTEMPTY
	expect err.unlink_dir "$(fsops try unlink "$P/e/dir")" EISDIR
	expect err.unlink_missing "$(fsops try unlink "$P/e/none")" ENOENT
	expect err.open_missing "$(fsops try open "$P/e/none")" ENOENT
	expect err.openw_dir "$(fsops try openw "$P/e/dir")" EISDIR
	expect err.opendir_file "$(fsops try opendir "$P/e/file")" ENOTDIR
	expect err.trailing_slash "$(fsops try open "$P/e/file/")" ENOTDIR
	expect err.rename_dir_over_file "$(fsops try rename "$P/e/dir" "$P/e/file")" ENOTDIR
	expect err.rename_file_over_dir "$(fsops try rename "$P/e/file" "$P/e/dir")" EISDIR
	expect err.rename_over_nonempty "$(fsops try rename "$P/e/dir" "$P/e/full")" ENOTEMPTY
	expect err.rename_into_self "$(fsops try rename "$P/e/dir" "$P/e/dir/sub")" EINVAL
	expect err.rename_missing "$(fsops try rename "$P/e/none" "$P/e/none2")" ENOENT
	expect err.link_missing "$(fsops try link "$P/e/none" "$P/e/l")" ENOENT
	expect err.link_exists "$(fsops try link "$P/e/file" "$P/e/dir")" EEXIST
	expect err.symlink_exists "$(fsops try symlink x "$P/e/file")" EEXIST
	expect err.readlink_file "$(fsops try readlink "$P/e/file")" EINVAL
	expect err.truncate_dir "$(fsops try truncate "$P/e/dir")" EISDIR
	n255=$(head -c 255 /dev/zero | tr '\0' n)
	expect err.name255 "$(fsops excl "$P/e/$n255")" ok
	expect err.name256 "$(fsops excl "$P/e/${n255}x")" ENAMETOOLONG
	expect err.name255.listed "$(ls "$P/e" | grep -c '^nnnn')" 1
	# unusual but valid names
	for n in 'with space' 'tab	in' 'é-ü-😀' '-dash' '.hidden' '...' 'back\slash' 'new
line'; do
		printf '%s' "$n" >"$P/e/$n" || echo "cannot create [$n]"
	done
	expect err.names "$(for n in 'with space' 'tab	in' 'é-ü-😀' '-dash' '.hidden' '...' 'back\slash' 'new
line'; do [ "$(cat "$P/e/$n")" = "$n" ] && printf 1 || printf 0; done)" 11111111
	expect err.names.count "$(fsops count "$P/e" 2>/dev/null | cut -d' ' -f1)" count=12
}

t_mmap() {
	printf 'hello mmap\n' >"$P/mm"
	# with cache=none files are FOPEN_DIRECT_IO; what the guest kernel allows
	# then depends on its version: recorded, compared between daemons
	note mmap.private "$(fsops mmap "$P/mm" private)"
	note mmap.shared "$(fsops mmap "$P/mm" shared)"
	note mmap.write "$(fsops mmap "$P/mm" write)"
	note mmap.content "$(flat cat "$P/mm")"
}

t_fifo() {
	mkfifo "$P/fifo"
	expect fifo.type "$(stat -c %F "$P/fifo")" fifo
	expect fifo.ls "$(ls -l "$P/fifo" | cut -c1)" p
	mknod "$P/fifo2" p
	expect fifo.mknod.type "$(stat -c %F "$P/fifo2")" fifo
	# the guest kernel serves FIFOs itself: no OPEN reaches the daemon
	expect fifo.rw "$(timeout 10 fsops fifo "$P/fifo")" "fifo=1 read=ping"
	expect fifo.after "$(flat ls "$P/fifo" "$P/fifo2")" "$P/fifo|$P/fifo2"
}

t_mknod() {
	mknod -m 0666 "$P/chr" c 1 5
	expect mknod.chr.type "$(stat -c '%F %t:%T %a' "$P/chr")" "character special file 1:5 666"
	expect mknod.chr.ls "$(ls -l "$P/chr" | cut -c1)" c
	mknod -m 0600 "$P/blk" b 7 0
	expect mknod.blk.type "$(stat -c '%F %t:%T %a' "$P/blk")" "block special file 7:0 600"
	# opening the node opens the guest's device (here /dev/zero), never the host's
	expect mknod.chr.open "$(timeout 10 fsops chr "$P/chr" 64)" "chr=1 bytes=64 zero=1 write=ok"
	expect mknod.after "$(flat ls "$P/chr" "$P/blk")" "$P/blk|$P/chr"
}

t_unlink_open() {
	printf 'still here\n' >"$P/uo"
	expect unlink_open "$(fsops unlinkopen "$P/uo")" "stat=ENOENT read=still here| reread=still here|+more nlink=0 size=16"
	expect unlink_open.gone "$(size "$P/uo")" missing
	# the same with the shell: read from an fd whose name is gone
	printf 'fd data\n' >"$P/uo2"
	exec 5<"$P/uo2"
	rm "$P/uo2"
	expect unlink_open.shell "$(cat <&5)" "fd data"
	exec 5<&-
	# rename over a file that is open
	printf 'old\n' >"$P/uo3"
	printf 'new\n' >"$P/uo4"
	exec 6<"$P/uo3"
	mv "$P/uo4" "$P/uo3"
	expect unlink_open.renamed_over "$(cat <&6) $(cat "$P/uo3")" "old new"
	exec 6<&-
}

t_readdir() {
	# /mnt/listing: LISTING (10000) empty files f00000... the host made before the boot
	t0=$(ms)
	expect readdir.listing "$(fsops count /mnt/listing 2>/dev/null | cut -d' ' -f1)" "count=$LISTING"
	timing "readdir.getdents.$LISTING" "$t0"
	note readdir.listing.names "$(fsops count /mnt/listing 2>/dev/null)"
	expect readdir.listing.stat "$(stat -c '%F %s' /mnt/listing/f05000)" "regular empty file 0"
	# $P/many: MANY files the guest creates with one fsops call (open O_CREAT|O_EXCL, close)
	mkdir "$P/many"
	t0=$(ms)
	expect readdir.create "$(fsops mkmany "$P/many" "$MANY")" "created=$MANY"
	timing "readdir.create.fsops.$MANY" "$t0"
	t0=$(ms)
	expect readdir.count "$(fsops count "$P/many" 2>/dev/null | cut -d' ' -f1)" "count=$MANY"
	timing "readdir.getdents.$MANY" "$t0"
	note readdir.names "$(fsops count "$P/many" 2>/dev/null)"
	# one ls -l (a LOOKUP and GETATTRs per entry: ~10 ms each under TCG) of
	# the first 1000 serves the remaining checks
	lsn=$MANY
	[ "$lsn" -gt 1000 ] && lsn=1000
	t0=$(ms)
	if [ "$MANY" -gt 1000 ]; then
		ls -l "$P/many"/f00[0-9][0-9][0-9] >/tmp/ls-many
	else
		ls -l "$P/many" >/tmp/ls-many
	fi
	timing "readdir.ls_l.$lsn" "$t0"
	expect readdir.ls_l "$(grep -c '^-rw-r--r-- *1 root *root *0 ' /tmp/ls-many)" "$lsn"
	expect readdir.first_last "$(grep '^-' /tmp/ls-many | sed -n '1p;$p' | awk '{print $NF}' | sed 's,.*/,,' | tr '\n' ' ')" \
		"f00000 f$(printf %05d $((lsn - 1))) "
	# the same with a shell loop (no fork per file: ':>' is a builtin redirection)
	mkdir "$P/loop"
	t0=$(ms)
	i=0
	while [ $i -lt "$LOOP" ]; do
		: >"$P/loop/g$i"
		i=$((i + 1))
	done
	timing "readdir.create.shellloop.$LOOP" "$t0"
	expect readdir.loop "$(fsops count "$P/loop" 2>/dev/null | cut -d' ' -f1)" "count=$LOOP"
	# unlink them all again
	t0=$(ms)
	rm -rf "$P/loop"
	timing "readdir.rm.$LOOP" "$t0"
	expect readdir.loop.gone "$(size "$P/loop")" missing
	# an empty directory lists nothing; rmdir of a non-empty one fails
	mkdir "$P/empty"
	expect readdir.empty "$(ls -a "$P/empty" | tr '\n' ' ')" ". .. "
	expect readdir.rmdir_nonempty "$(rmdir "$P/r2" 2>&1 | grep -c 'not empty')" 1
}

t_xattr() {
	echo x >"$P/xa"
	expect xattr.set "$(fsops setx "$P/xa" user.test value1)" ok
	expect xattr.get "$(fsops getx "$P/xa" user.test)" value1
	expect xattr.set2 "$(fsops setx "$P/xa" user.other "two words")" ok
	expect xattr.list "$(fsops listx "$P/xa")" user.other,user.test
	expect xattr.create_exists "$(fsops setx "$P/xa" user.test v create)" EEXIST
	expect xattr.replace_missing "$(fsops setx "$P/xa" user.none v replace)" ENODATA
	expect xattr.replace "$(fsops setx "$P/xa" user.test value2 replace)" ok
	expect xattr.get2 "$(fsops getx "$P/xa" user.test)" value2
	expect xattr.remove "$(fsops rmx "$P/xa" user.other)" ok
	expect xattr.get_removed "$(fsops getx "$P/xa" user.other)" ENODATA
	expect xattr.remove_missing "$(fsops rmx "$P/xa" user.other)" ENODATA
	expect xattr.list2 "$(fsops listx "$P/xa")" user.test
	mkdir "$P/xdir"
	expect xattr.dir.set "$(fsops setx "$P/xdir" user.dir dirval)" ok
	expect xattr.dir.get "$(fsops getx "$P/xdir" user.dir)" dirval
	expect xattr.dir.list "$(fsops listx "$P/xdir")" user.dir
	# user.* is not allowed on symlinks (the guest kernel or the host says EPERM)
	expect xattr.symlink "$(fsops lsetx "$P/sl" user.test v)" EPERM
	# trusted.* needs CAP_SYS_ADMIN in the daemon, which both daemons' sandboxes drop
	note xattr.trusted "$(fsops setx "$P/xa" trusted.test tval)"
	note xattr.trusted.get "$(fsops getx "$P/xa" trusted.test)"
	expect xattr.empty_list "$(fsops listx "$P/a")" -
	# a 3000-byte value; a buffer too small for it
	expect xattr.big "$(fsops setx "$P/xa" user.big "$(head -c 3000 /dev/zero | tr '\0' v)")" ok
	expect xattr.big.get "$(fsops getx "$P/xa" user.big)" "len=3000 sum=cadc8d00"
	expect xattr.erange "$(fsops getxsmall "$P/xa" user.big)" ERANGE
	expect xattr.big.remove "$(fsops rmx "$P/xa" user.big)" ok
	# special files and symlinks: the daemon must not open (FIFO: would block)
	# nor follow them to answer; timeout turns a hung request into a result
	expect xattr.fifo.list "$(timeout 10 fsops listx "$P/fifo")" -
	expect xattr.fifo.get "$(timeout 10 fsops getx "$P/fifo" trusted.none)" ENODATA
	expect xattr.fifo.user "$(timeout 10 fsops setx "$P/fifo" user.x v)" EPERM
	note xattr.fifo.trusted "$(timeout 10 fsops setx "$P/fifo" trusted.t v)"
	expect xattr.chr.list "$(timeout 10 fsops listx "$P/chr")" -
	expect xattr.chr.get "$(timeout 10 fsops getx "$P/chr" trusted.none)" ENODATA
	expect xattr.symlink.list "$(timeout 10 fsops llistx "$P/sl")" -
	expect xattr.symlink.get "$(timeout 10 fsops lgetx "$P/sl" trusted.none)" ENODATA
	expect xattr.symlink.follow "$(timeout 10 fsops listx "$P/sl")" -
	expect xattr.after "$(flat ls "$P/fifo")" "$P/fifo"
	# one more left for the host check (user.keep=kept on xa)
	expect xattr.keep "$(fsops setx "$P/xa" user.keep kept)" ok
}

t_seek() {
	# data at [0,4K) and [1M,1M+4K), size 2M
	printf 'data' | dd of="$P/holes" bs=4096 conv=sync 2>/dev/null
	printf 'more' | dd of="$P/holes" bs=4096 seek=256 conv=sync,notrunc 2>/dev/null
	truncate -s 2097152 "$P/holes"
	expect seek.size "$(size "$P/holes")" 2097152
	expect seek.data0 "$(fsops seek "$P/holes" data 0)" 0
	expect seek.hole0 "$(fsops seek "$P/holes" hole 0)" 4096
	expect seek.data4k "$(fsops seek "$P/holes" data 4096)" 1048576
	expect seek.hole1m "$(fsops seek "$P/holes" hole 1048576)" 1052672
	expect seek.data_tail "$(fsops seek "$P/holes" data 1052672)" ENXIO
	expect seek.hole_mid "$(fsops seek "$P/holes" hole 1572864)" 1572864
	expect seek.hole_eof "$(fsops seek "$P/holes" hole 2097152)" ENXIO
	expect seek.data_eof "$(fsops seek "$P/holes" data 3000000)" ENXIO
}

t_fallocate() {
	: >"$P/fa"
	expect falloc.alloc "$(fsops falloc "$P/fa" 0 0 1048576)" ok
	expect falloc.alloc.size "$(size "$P/fa")" 1048576
	expect falloc.alloc.blocks "$(stat -c %b "$P/fa")" 2048
	expect falloc.keep "$(fsops falloc "$P/fa" keep 1048576 1048576)" ok
	expect falloc.keep.size "$(size "$P/fa")" 1048576
	expect falloc.keep.blocks "$(stat -c %b "$P/fa")" 4096
	fsops gen 2 1048576 | dd of="$P/fa" bs=65536 conv=notrunc 2>/dev/null
	expect falloc.punch "$(fsops falloc "$P/fa" punch 65536 131072)" ok
	expect falloc.punch.size "$(size "$P/fa")" 1048576
	expect falloc.punch.blocks "$(stat -c %b "$P/fa")" 3840
	expect falloc.punch.zeros "$(dd if="$P/fa" bs=65536 skip=1 count=2 2>/dev/null | md5sum | cut -d' ' -f1)" "$(zeros_md5 131072)"
	expect falloc.punch.hole "$(fsops seek "$P/fa" hole 0)" 65536
	expect falloc.punch.data "$(fsops seek "$P/fa" data 65536)" 196608
	# ZERO_RANGE: whether the guest kernel passes it on depends on its version
	note falloc.zero_range "$(fsops falloc "$P/fa" zero 0 4096)"
}

t_copy() {
	head -c 300000 /tmp/rand1m >"$P/cs"
	expect copy.whole "$(fsops copy "$P/cs" 0 "$P/cd" 0 300000)" 300000
	expect copy.whole.md5 "$(md5 "$P/cd")" "$(md5 "$P/cs")"
	expect copy.offsets "$(fsops copy "$P/cs" 8192 "$P/cd2" 100 4096)" 4096
	expect copy.offsets.size "$(size "$P/cd2")" 4196
	expect copy.offsets.data "$(tail -c 4096 "$P/cd2" | md5sum | cut -d' ' -f1)" \
		"$(dd if="$P/cs" bs=4096 skip=2 count=1 2>/dev/null | md5sum | cut -d' ' -f1)"
	expect copy.offsets.zeros "$(head -c 100 "$P/cd2" | md5sum | cut -d' ' -f1)" "$(zeros_md5 100)"
	expect copy.past_eof "$(fsops copy "$P/cs" 400000 "$P/cd3" 0 100)" 0
}

t_sync() {
	echo synced >"$P/sy"
	sync
	expect sync.all $? 0
	expect sync.file "$(flat sync "$P/sy")" ""
	expect sync.data "$(flat sync -d "$P/sy")" ""
	expect sync.fs "$(flat sync -f "$P/sy")" ""
	expect fsyncdir "$(fsops fsyncdir "$P")" ok
	expect syncfs "$(fsops syncfs "$P")" ok
	expect fsync "$(fsops fsync "$P/sy")" ok
}

t_tmpfile() {
	mkdir "$P/tmpd"
	expect tmpfile "$(fsops tmpfile "$P/tmpd" "$P/tmpd/linked" "tmp data")" \
		"open=ok write=ok nlink_before=0 link=ok nlink_after=1 mode=600 size=8"
	expect tmpfile.linked "$(cat "$P/tmpd/linked" 2>/dev/null || echo missing)" "tmp data"
	expect tmpfile.dir "$(flat ls "$P/tmpd")" "linked"
}

t_statx() {
	printf '12345' >"$P/sx"
	chmod 0604 "$P/sx"
	TZ=UTC touch -d '2010-01-02 03:04:05' "$P/sx"
	# btime is there only if the daemon answers FUSE_STATX (sent by newer guests)
	expect statx "$(fsops statx "$P/sx" | sed 's/ btime=[01] btime_ok=[01]//')" \
		"basic=1 mode=100604 nlink=1 uid=0 gid=0 size=5 blocks=8 mtime=1262401445"
	note statx.btime "$(fsops statx "$P/sx" | cut -d' ' -f2,3)"
	expect statx.dir "$(fsops statx "$P/r2" | cut -d' ' -f4)" mode=40755
}

t_statfs() {
	note statfs.type "$(stat -f -c %T "$P")"
	expect statfs.bsize_positive "$([ "$(stat -f -c %S "$P")" -gt 0 ] && echo yes)" yes
}

# The files each check made, as the host will see them; run again after the remount.
fingerprint() {
	(
		cd "$P" || exit 1
		stat -c '%n:%F:%a:%h:%s:%u:%g' a big t app sparse tr r2/c r2/y r2/z h sl st m fifo chr xa holes \
			fa cd cd2 sy sx kp1 pub/file sg/dir e/file
		md5sum a big app sparse tr r2/c h st xa holes fa cd cd2 sy sx
		readlink sl sldir slabs
	) 2>&1 | md5sum | cut -d' ' -f1
}

t_remount() {
	before=$(fingerprint)
	count=$(fsops count "$P/many" 2>/dev/null)
	listing=$(fsops count /mnt/listing 2>/dev/null)
	cd /
	umount /mnt
	expect remount.umount $? 0
	expect remount.unmounted "$(grep -c ' /mnt ' /proc/mounts)" 0
	mount -t virtiofs "$E2E_TAG" /mnt
	expect remount.mount $? 0
	expect remount.fingerprint "$(fingerprint)" "$before"
	expect remount.many "$(fsops count "$P/many" 2>/dev/null)" "$count"
	expect remount.listing "$(fsops count /mnt/listing 2>/dev/null)" "$listing"
	expect remount.xattr "$(fsops getx "$P/xa" user.keep)" kept
	expect remount.write "$(echo after >"$P/after" && cat "$P/after")" after
}

T0=$(ms)
step setup check t_setup || exit 1
step create check t_create
step otrunc check t_trunc
step oappend check t_append
step oexcl check t_excl
step sparse check t_sparse
step truncate check t_truncate
step rename check t_rename
step hardlink check t_hardlink
step symlink check t_symlink
step attrs check t_attrs
step killpriv check t_killpriv
step creds check t_creds
step errors check t_errors
step mmap check t_mmap
step fifo check t_fifo
step mknod check t_mknod
step unlink_open check t_unlink_open
step readdir check t_readdir
step xattr check t_xattr
step seek check t_seek
step fallocate check t_fallocate
step copy_file_range check t_copy
step sync check t_sync
step tmpfile check t_tmpfile
step statx check t_statx
step statfs check t_statfs
step remount check t_remount
timing posix.total "$T0"
