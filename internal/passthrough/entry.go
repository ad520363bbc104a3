package passthrough

import (
	"bytes"
	"math"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Name checks. Every name from the guest goes through one of these,
// whatever the sandbox.

// checkName accepts one path component other than "." and "..".
func checkName(name []byte) syscall.Errno {
	if errno := checkLookupName(name); errno != 0 {
		return errno
	}
	if isDotOrDotDot(name) {
		return syscall.EINVAL
	}
	return 0
}

// checkLookupName accepts one path component, "." and ".." included.
func checkLookupName(name []byte) syscall.Errno {
	if len(name) == 0 {
		return syscall.EINVAL
	}
	if len(name) > nameMax {
		return syscall.ENAMETOOLONG
	}
	if bytes.IndexByte(name, '/') >= 0 || bytes.IndexByte(name, 0) >= 0 {
		return syscall.EINVAL
	}
	return 0
}

func isDotOrDotDot(name []byte) bool {
	return name[0] == '.' && (len(name) == 1 || (len(name) == 2 && name[1] == '.'))
}

const statxMask = unix.STATX_BASIC_STATS | unix.STATX_MNT_ID

func statxFD(fd int, st *unix.Statx_t) syscall.Errno {
	return sysStatx(fd, &emptyPath[0], unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW, statxMask, st)
}

// openBeneath2 opens path (one or more components) below dirfd as O_PATH
// with openat2: no symlink followed, nothing outside dirfd reached. The
// kernel answers EAGAIN when a rename raced the lookup: it is retried.
func (f *FS) openBeneath2(dirfd int, path *byte) (int, syscall.Errno) {
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveFlags}
	for range 8 {
		fd, e := sysOpenat2(dirfd, path, &how)
		if e == unix.EAGAIN {
			continue
		}
		if e == 0 {
			f.inodeFDs.Add(1)
		}
		return fd, e
	}
	return -1, syscall.EAGAIN
}

// openChild opens one component below dir as O_PATH without following a
// trailing symlink. name must have passed checkLookupName and must not be "..".
// Out of fds, it sheds inode fds and tries once more (outOfFDs).
func (f *FS) openChild(dirfd int, name *byte) (int, syscall.Errno) {
	return f.withFDs(true, func() (int, syscall.Errno) { return f.openChildOnce(dirfd, name) })
}

func (f *FS) openChildOnce(dirfd int, name *byte) (int, syscall.Errno) {
	if f.openat2.Load() {
		return f.openBeneath2(dirfd, name)
	}
	fd, e := sysOpenat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if e == 0 {
		f.inodeFDs.Add(1)
	}
	return fd, e
}

// lookupName resolves name in dir, adds a guest lookup and fills out.
func (f *FS) lookupName(dir iref, name []byte, out *gofuse.EntryOut) syscall.Errno {
	if !dir.isDir() {
		return syscall.ENOTDIR
	}
	var fd int
	var errno syscall.Errno
	switch {
	case len(name) == 2 && name[0] == '.' && name[1] == '.':
		fd, errno = f.openParent(dir)
		name = nil // no name to record: dir's parent is not known by one
	default:
		var cn cname
		p := cn.set(name)
		if f.useHandles {
			if errno, done := f.lookupByHandle(dir, p, out); done {
				return errno
			}
		}
		fd, errno = f.openChild(dir.fd, p)
	}
	if errno != 0 {
		return errno
	}
	return f.internFD(fd, dir.inode, name, out)
}

// lookupByHandle is LOOKUP of a name that is not a directory, on a mount
// held by file handle, without opening it: a statx and a name_to_handle_at
// of the name (neither follows a trailing symlink, and one component
// below dir cannot leave it), where opening it as O_PATH, as the other
// lookups do, took a fifth of the daemon's CPU time on a LOOKUP walk. A
// new inode is made only if a second statx finds the same object at the
// name: a host-side rename between the first two calls would otherwise
// pair one object's attributes with another's handle. done is false when
// the caller must look the name up by fd (a directory, a mount not held by
// handle, a race).
func (f *FS) lookupByHandle(dir iref, p *byte, out *gofuse.EntryOut) (errno syscall.Errno, done bool) {
	var st unix.Statx_t
	if e := sysStatx(dir.fd, p, unix.AT_SYMLINK_NOFOLLOW, statxMask, &st); e != 0 {
		return e, true
	}
	if uint32(st.Mode)&unix.S_IFMT == unix.S_IFDIR {
		return 0, false
	}
	if handles, known := f.mountHandles(st.Mnt_id); !handles || !known {
		return 0, false
	}
	var hb handleBuf
	mnt, e := hb.encodeName(dir.fd, p, 0)
	if e != 0 || uint64(mnt) != st.Mnt_id {
		return 0, false
	}
	key := keyOf(&st)
	key.handle = hb.view()
	i, found := f.internKnown(key)
	if !found {
		var again unix.Statx_t
		if sysStatx(dir.fd, p, unix.AT_SYMLINK_NOFOLLOW, statxMask, &again) != 0 ||
			keyOf(&again) != keyOf(&st) || (again.Mode^st.Mode)&unix.S_IFMT != 0 {
			return 0, false
		}
		if i, errno = f.intern(-1, &st, key); errno != 0 {
			return errno, errno != errNeedFD
		}
	}
	f.fillEntry(out, i, &st, dir.key.mntID)
	return 0, true
}

// internFD stats an O_PATH fd, interns it (taking ownership of fd), records
// name in dir as where it was found (nil: nowhere) and fills out with one
// new lookup reference.
func (f *FS) internFD(fd int, dir *inode, name []byte, out *gofuse.EntryOut) syscall.Errno {
	var st unix.Statx_t
	if errno := statxFD(fd, &st); errno != 0 {
		sysClose(fd)
		f.inodeFDs.Add(-1)
		return errno
	}
	i, errno := f.internOpened(fd, &st)
	if errno != 0 {
		return errno
	}
	if name != nil {
		f.noteName(i, dir, name)
	}
	f.fillEntry(out, i, &st, dir.key.mntID)
	return 0
}

// openParent opens dir's parent, never above the shared root: ".." of the
// root is the root, and a parent that is not the root or below it (the
// directory was moved out of the share on the host) is refused.
func (f *FS) openParent(dir iref) (int, syscall.Errno) {
	if dir.inode == f.root || dir.key.sameObject(f.root.key) {
		return f.dupRoot()
	}
	fd, e := sysOpenat(dir.fd, &dotdotPath[0], unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if e != 0 {
		return -1, e
	}
	f.inodeFDs.Add(1)
	if errno := f.checkBelowRoot(fd); errno != 0 {
		sysClose(fd)
		f.inodeFDs.Add(-1)
		return -1, errno
	}
	return fd, 0
}

func (f *FS) dupRoot() (int, syscall.Errno) {
	fd, err := unix.FcntlInt(uintptr(f.rootFD()), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, toErrno(err)
	}
	f.inodeFDs.Add(1)
	return fd, 0
}

// checkBelowRoot walks up from the directory fd to the root: ok if the root
// is reached, EACCES if the host's / is reached first.
func (f *FS) checkBelowRoot(fd int) syscall.Errno {
	cur := fd
	defer func() {
		if cur != fd {
			sysClose(cur)
		}
	}()
	var st unix.Statx_t
	for range 4096 {
		if e := statxFD(cur, &st); e != 0 {
			return e
		}
		k := keyOf(&st)
		if k.sameObject(f.root.key) {
			return 0
		}
		up, e := sysOpenat(cur, &dotdotPath[0], unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if e != 0 {
			return e
		}
		var ust unix.Statx_t
		if e := statxFD(up, &ust); e != 0 {
			sysClose(up)
			return e
		}
		if keyOf(&ust) == k {
			sysClose(up) // reached the host's root
			return syscall.EACCES
		}
		if cur != fd {
			sysClose(cur)
		}
		cur = up
	}
	return syscall.ELOOP
}

// Lookup resolves name in directory h.NodeId.
func (f *FS) Lookup(h *gofuse.InHeader, name []byte, out *gofuse.EntryOut) syscall.Errno {
	if errno := checkLookupName(name); errno != 0 {
		return errno
	}
	dir, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return errno
	}
	defer dir.put()
	return f.lookupName(dir, name, out)
}

// Forget drops nlookup guest references to nodeID.
func (f *FS) Forget(nodeID, nlookup uint64) {
	if nodeID == rootID {
		return
	}
	i := f.nodes.get(nodeID)
	if i == nil {
		return
	}
	f.forget(i, nlookup)
}

// GetAttr returns the attributes of in.NodeId (of handle in.Fh() when
// FUSE_GETATTR_FH is set).
func (f *FS) GetAttr(in *gofuse.GetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	fd, h, errno := f.statFD(i, in.Flags()&gofuse.FUSE_GETATTR_FH != 0, in.Fh())
	if errno != 0 {
		return errno
	}
	if h != nil {
		defer h.put()
	}
	if errno := f.statOut(fd, out); errno != 0 {
		return errno
	}
	f.setAttrDAX(i.inode, &out.Attr)
	return 0
}

// statFD is the fd GETATTR and STATX read: with FUSE_GETATTR_FH (withFH)
// that of handle fh when it is one of i's, else i's own. The handle it
// returns, if any, is held for the caller to put.
func (f *FS) statFD(i iref, withFH bool, fh uint64) (int, *handle, syscall.Errno) {
	if withFH {
		h, errno := f.handleOf(fh, i.inode)
		if errno != 0 {
			return -1, nil, errno
		}
		if h != nil {
			return h.fd, h, 0
		}
	}
	return i.fd, nil, 0
}

// statOut fills out with the attributes of fd's object (GETATTR, SETATTR).
func (f *FS) statOut(fd int, out *gofuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if errno := sysFstat(fd, &st); errno != 0 {
		return errno
	}
	f.fillAttrOut(out, &st)
	return 0
}

// procName returns the /proc/self/fd name of fd.
func procName(b *fdName, fd int) *byte { return b.set(fd) }

// reopen opens the object behind an inode's O_PATH fd for I/O through
// /proc/self/fd. Only regular files and directories are ever opened.
func (f *FS) reopen(i iref, flags int) (int, syscall.Errno) {
	if !i.isReg() && !i.isDir() {
		return -1, syscall.EBADF
	}
	var b fdName
	p := procName(&b, i.fd)
	return f.withFDs(true, func() (int, syscall.Errno) {
		return sysOpenat(f.procSelfFD, p, (flags&^unix.O_NOFOLLOW)|unix.O_CLOEXEC, 0)
	})
}

// killPriv clears set-user-ID, and set-group-ID if the group may execute,
// on a regular file: what the kernel does on write/truncate by a caller
// without CAP_FSETID, which the daemon (holding CAP_FSETID) must do itself
// when the guest's flags ask for it. fd may be an open fd or an O_PATH fd.
func (f *FS) killPriv(fd int, opath bool) syscall.Errno {
	var st syscall.Stat_t
	if e := sysFstat(fd, &st); e != 0 {
		return e
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0
	}
	mode := st.Mode & 0o7777
	nm := mode &^ unix.S_ISUID
	if mode&(unix.S_ISGID|unix.S_IXGRP) == unix.S_ISGID|unix.S_IXGRP {
		nm &^= unix.S_ISGID
	}
	if nm == mode {
		return 0
	}
	var e syscall.Errno
	if opath {
		var b fdName
		e = sysFchmodat(f.procSelfFD, procName(&b, fd), nm)
	} else {
		e = sysFchmod(fd, nm)
	}
	if e == syscall.EPERM {
		// The daemon does not own the file and lacks CAP_FOWNER; then
		// it lacks CAP_FSETID too and the kernel clears the bits itself.
		return 0
	}
	return e
}

// SetAttr changes attributes: mode, owner, size, times (ctime is ignored,
// as in the C daemon), with kill-priv when FATTR_KILL_SUIDGID is set.
func (f *FS) SetAttr(in *gofuse.SetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	valid := in.Valid
	const changes = gofuse.FATTR_MODE | gofuse.FATTR_UID | gofuse.FATTR_GID | gofuse.FATTR_SIZE |
		gofuse.FATTR_ATIME | gofuse.FATTR_MTIME | gofuse.FATTR_ATIME_NOW | gofuse.FATTR_MTIME_NOW
	if f.opts.ReadOnly && valid&changes != 0 {
		return syscall.EROFS
	}
	hfd := -1
	if valid&gofuse.FATTR_FH != 0 {
		h, herr := f.handleOf(in.Fh, i.inode)
		if herr != 0 {
			return herr
		}
		if h == nil {
			return syscall.EBADF
		}
		defer h.put()
		hfd = h.fd
	}

	if valid&gofuse.FATTR_KILL_SUIDGID != 0 && valid&gofuse.FATTR_MODE == 0 && i.isReg() {
		if hfd >= 0 {
			errno = f.killPriv(hfd, false)
		} else {
			errno = f.killPriv(i.fd, true)
		}
		if errno != 0 {
			return errno
		}
	}
	if valid&gofuse.FATTR_MODE != 0 {
		if errno = f.setMode(i, hfd, in.Mode&0o7777); errno != 0 {
			return errno
		}
	}
	if valid&(gofuse.FATTR_UID|gofuse.FATTR_GID) != 0 {
		if errno = f.setOwner(i, in); errno != 0 {
			return errno
		}
	}
	if valid&gofuse.FATTR_SIZE != 0 {
		if errno = f.setSizeMapped(i, hfd, int64(in.Size)); errno != 0 {
			return errno
		}
	}
	if valid&(gofuse.FATTR_ATIME|gofuse.FATTR_MTIME) != 0 {
		if errno = f.setTimes(i, hfd, in); errno != 0 {
			return errno
		}
	}
	if hfd < 0 {
		hfd = i.fd
	}
	if errno = f.statOut(hfd, out); errno != 0 {
		return errno
	}
	f.setAttrDAX(i.inode, &out.Attr)
	return 0
}

// setSizeMapped is setSize keeping i's DAX tails right: written back
// before the file changes size, refreshed after (dax.go).
func (f *FS) setSizeMapped(i iref, hfd int, size int64) syscall.Errno {
	if !f.dax.on.Load() {
		return f.setSize(i, hfd, size)
	}
	nt := i.lockTails()
	i.writeBackTails(nt, true)
	errno := f.setSize(i, hfd, size)
	i.tailsChanged(nt, 0, math.MaxUint64)
	return errno
}

// The steps of SETATTR: each changes i's object, through the handle's fd
// hfd when the guest gave one (-1 otherwise).

func (f *FS) setMode(i iref, hfd int, mode uint32) syscall.Errno {
	switch {
	case hfd >= 0:
		return sysFchmod(hfd, mode)
	case i.isSymlink():
		return syscall.EOPNOTSUPP // Linux cannot chmod a symlink
	}
	var b fdName
	return sysFchmodat(f.procSelfFD, procName(&b, i.fd), mode)
}

// setOwner sets the uid and gid in says are valid, as host ids
// (--translate-uid/--translate-gid): EPERM for one a map forbids.
func (f *FS) setOwner(i iref, in *gofuse.SetAttrIn) syscall.Errno {
	var uids, gids *IDMap // nil: ids pass unchanged
	if f.ids != nil {
		uids, gids = f.ids.uid, f.ids.gid
	}
	uid, gid := -1, -1
	if in.Valid&gofuse.FATTR_UID != 0 {
		h, ok := uids.ToHost(in.Uid)
		if !ok {
			return syscall.EPERM
		}
		uid = int(h)
	}
	if in.Valid&gofuse.FATTR_GID != 0 {
		h, ok := gids.ToHost(in.Gid)
		if !ok {
			return syscall.EPERM
		}
		gid = int(h)
	}
	return sysFchownat(i.fd, &emptyPath[0], uid, gid, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
}

// setSize truncates a regular file (or the handle's file).
func (f *FS) setSize(i iref, hfd int, size int64) syscall.Errno {
	if size < 0 {
		return syscall.EINVAL
	}
	if hfd >= 0 {
		return sysFtruncate(hfd, size)
	}
	if i.isDir() {
		return syscall.EISDIR
	}
	if !i.isReg() {
		return syscall.EINVAL
	}
	fd, errno := f.reopen(i, unix.O_WRONLY)
	if errno != 0 {
		return errno
	}
	defer sysClose(fd)
	return sysFtruncate(fd, size)
}

// setTimes sets the access and modification times in says are valid.
func (f *FS) setTimes(i iref, hfd int, in *gofuse.SetAttrIn) syscall.Errno {
	v := in.Valid
	ts := [2]unix.Timespec{
		utimeSpec(v&gofuse.FATTR_ATIME != 0, v&gofuse.FATTR_ATIME_NOW != 0, in.Atime, in.Atimensec),
		utimeSpec(v&gofuse.FATTR_MTIME != 0, v&gofuse.FATTR_MTIME_NOW != 0, in.Mtime, in.Mtimensec),
	}
	switch {
	case hfd >= 0:
		return sysUtimensat(hfd, nil, &ts, 0)
	case i.isSymlink():
		errno := sysUtimensat(i.fd, &emptyPath[0], &ts, unix.AT_EMPTY_PATH)
		if errno == syscall.EINVAL {
			errno = syscall.EPERM // no race-free way on this kernel
		}
		return errno
	}
	var b fdName
	return sysUtimensat(f.procSelfFD, procName(&b, i.fd), &ts, 0)
}

// utimeSpec is one time for utimensat: left alone unless set, the current
// time with now, else sec and nsec.
func utimeSpec(set, now bool, sec uint64, nsec uint32) unix.Timespec {
	switch {
	case !set:
		return unix.Timespec{Nsec: unix.UTIME_OMIT}
	case now:
		return unix.Timespec{Nsec: unix.UTIME_NOW}
	}
	return unix.Timespec{Sec: int64(sec), Nsec: int64(nsec)}
}
