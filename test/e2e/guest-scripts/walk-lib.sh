# Walks of a big tree as find, ls -lR and git status make them (sourced by
# walk.sh for TestGuestWalk and by bench.sh for bench-guest's walk-* rows;
# not a script of its own: it only defines functions).
#
# walk_op OP DIR: one walk of DIR, timed. OP is
#   find   find DIR -type f, the list kept in /tmp/walk.DIR.list (for stat2;
#          DIR with its slashes as dots)
#   ls     ls -lR DIR, the regular files (lines starting with '-') counted
#   stat2  every file of DIR's list lstat'ed twice (fsops lstatlist:
#          busybox xargs garbles a list this long under TCG), as git
#          status lstat's every file of its index; the list is made first,
#          untimed, if no find made it
# and prints one line
#   E2E-WALK OP files=N errors=E emfile=M estale=S cs=T
# (N regular files seen, for stat2 the stats that answered in the two passes
# together; E lines on stderr, M of them "Too many open files" (EMFILE,
# ENFILE), S "Stale file handle"; T centiseconds), then the first
# three stderr lines. It returns the walk's exit status.

walk_cs() {
	read -r _up _ </proc/uptime
	echo "${_up%.*}${_up#*.}"
}

walk_op() {
	_op=$1
	_wd=$2
	_list=/tmp/walk$(echo "$_wd" | tr / .).list
	: >/tmp/walk.err
	if [ "$_op" = stat2 ] && [ ! -s "$_list" ]; then
		find "$_wd" -type f >"$_list" 2>/dev/null
	fi
	_t0=$(walk_cs)
	case $_op in
	find)
		find "$_wd" -type f >"$_list" 2>/tmp/walk.err
		_rc=$?
		_n=$(wc -l <"$_list")
		;;
	ls)
		ls -lR "$_wd" >/tmp/walk.ls 2>/tmp/walk.err
		_rc=$?
		_n=$(grep -c '^-' /tmp/walk.ls)
		rm -f /tmp/walk.ls
		;;
	stat2)
		_rc=0
		_n=0
		for _pass in 1 2; do
			fsops lstatlist "$_list" >/tmp/walk.out 2>>/tmp/walk.err || _rc=$?
			read -r _st _ </tmp/walk.out
			case $_st in
			stat=*) _n=$((_n + ${_st#stat=})) ;;
			*) echo "fsops lstatlist: $_st" >>/tmp/walk.err ;;
			esac
		done
		rm -f /tmp/walk.out
		;;
	*)
		echo "walk_op: unknown walk $_op"
		return 2
		;;
	esac
	_t1=$(walk_cs)
	_e=$(wc -l </tmp/walk.err)
	_m=$(grep -c -e 'Too many open files' -e 'open files in system' /tmp/walk.err)
	_s=$(grep -c 'Stale file handle' /tmp/walk.err)
	[ "$_e" = 0 ] || [ "$_rc" != 0 ] || _rc=1
	echo "E2E-WALK $_op files=$_n errors=$_e emfile=$_m estale=$_s cs=$((_t1 - _t0))"
	head -n 3 /tmp/walk.err
	return $_rc
}

# walk_drop: the guest forgets what it cached (sync, drop_caches: its
# dentries and inodes go, and FUSE_FORGET tells the daemon), so the next
# walk starts cold.
walk_drop() {
	sync
	echo 3 >/proc/sys/vm/drop_caches
}
