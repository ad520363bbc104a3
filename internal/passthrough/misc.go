package passthrough

import (
	"bytes"
	"sync"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// StatFs reports the host file system holding h.NodeId.
func (f *FS) StatFs(h *gofuse.InHeader, out *gofuse.StatfsOut) syscall.Errno {
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	var st syscall.Statfs_t
	if err := syscall.Fstatfs(i.fd, &st); err != nil {
		return toErrno(err)
	}
	*out = gofuse.StatfsOut{}
	out.FromStatfsT(&st)
	return 0
}

// Access checks in.Mask against the mode bits for the caller's uid/gid
// (the Rust daemon's check). No credentials are switched: the guest kernel
// normally checks permissions itself (virtio-fs mounts use
// default_permissions), so ACCESS is rare.
func (f *FS) Access(in *gofuse.AccessIn) syscall.Errno {
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	var st syscall.Stat_t
	if errno = sysFstat(i.fd, &st); errno != 0 {
		return errno
	}
	mask := in.Mask & (unix.R_OK | unix.W_OK | unix.X_OK)
	if mask == 0 {
		return 0
	}
	if mask&unix.W_OK != 0 && f.opts.ReadOnly {
		return syscall.EROFS
	}
	if in.Uid == invalidUIDGID || in.Gid == invalidUIDGID {
		// With FUSE_ALLOW_IDMAP only creation requests carry the
		// caller's ids; the guest's default_permissions (always on for
		// virtio-fs) already checked this one. The id is no one's: it
		// is neither compared with the file's owner nor translated.
		return 0
	}
	uid, gid, mode := in.Uid, in.Gid, st.Mode
	if f.ids != nil {
		if uid, gid, errno = f.ids.toHost(uid, gid); errno != 0 {
			return errno
		}
	}
	allowed := func(bit uint32) bool {
		switch {
		case st.Uid == uid:
			return mode&(bit<<6) != 0
		case st.Gid == gid:
			return mode&(bit<<3) != 0
		}
		return mode&bit != 0
	}
	if uid == 0 {
		// root may read and write anything, and execute anything that
		// someone may execute (or search any directory).
		if mask&unix.X_OK != 0 && mode&0o111 == 0 && mode&unix.S_IFMT != unix.S_IFDIR {
			return syscall.EACCES
		}
		return 0
	}
	for _, bit := range []uint32{unix.R_OK, unix.W_OK, unix.X_OK} {
		if mask&bit != 0 && !allowed(bit) {
			return syscall.EACCES
		}
	}
	return 0
}

// SyncFs syncs the file system holding h.NodeId.
func (f *FS) SyncFs(h *gofuse.InHeader) syscall.Errno {
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	target := i
	if !i.isDir() && !i.isReg() {
		target = iref{inode: f.root, fd: f.rootFD()}
	}
	fl := unix.O_RDONLY | unix.O_NONBLOCK
	if target.isDir() {
		fl |= unix.O_DIRECTORY
	}
	fd, errno := f.reopen(target, fl)
	if errno != 0 {
		return errno
	}
	defer sysClose(fd)
	return toErrno(unix.Syncfs(fd))
}

// Statx answers FUSE_STATX with statx(2) on the inode (or the handle).
func (f *FS) Statx(in *gofuse.StatxIn, out *gofuse.StatxOut) syscall.Errno {
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	fd, h, errno := f.statFD(i, in.GetattrFlags&gofuse.FUSE_GETATTR_FH != 0, in.Fh)
	if errno != 0 {
		return errno
	}
	if h != nil {
		defer h.put()
	}
	var st unix.Statx_t
	flags := unix.AT_EMPTY_PATH | unix.AT_SYMLINK_NOFOLLOW | int(in.SxFlags&atStatxSyncType)
	if errno = sysStatx(fd, &emptyPath[0], flags, in.SxMask|unix.STATX_BASIC_STATS, &st); errno != 0 {
		return errno
	}
	*out = gofuse.StatxOut{}
	out.Statx.FromStatx(&st)
	if f.ids != nil {
		f.ids.toGuest(&out.Statx.Uid, &out.Statx.Gid)
	}
	out.AttrValid = uint64(f.attrTimeout / 1e9)
	out.AttrValidNsec = uint32(f.attrTimeout % 1e9)
	return 0
}

// --- extended attributes ---

const xattrNameMax = 255
const xattrSizeMax = 64 << 10

func checkXattrName(name []byte) syscall.Errno {
	if len(name) == 0 || bytes.IndexByte(name, 0) >= 0 {
		return syscall.EINVAL
	}
	if len(name) > xattrNameMax {
		return syscall.ERANGE
	}
	return 0
}

var aclPrefix = []byte("system.posix_acl_")

// xattrName validates and maps a guest xattr name to the host name, into cn.
func (f *FS) xattrName(name []byte, cn *cname) (*byte, syscall.Errno) {
	if errno := checkXattrName(name); errno != 0 {
		return nil, errno
	}
	if !f.aclOn() && bytes.HasPrefix(name, aclPrefix) {
		// The guest kernel enforces no ACLs without FUSE_POSIX_ACL;
		// the host must not apply ones it would ignore.
		return nil, syscall.EOPNOTSUPP
	}
	if f.xmap != nil {
		mapped, errno := f.xmap.toHost(name)
		if errno != 0 {
			return nil, errno
		}
		name = mapped
		if len(name) > xattrNameMax {
			return nil, syscall.ERANGE
		}
	}
	return cn.set(name), 0
}

// withXattrTarget runs fn against i: through an fd (regular files and
// directories, reopened read-only) or, for symlinks and special files,
// which must not be opened, through the /proc/self/fd name on a worker
// whose cwd is /proc/self/fd.
func (f *FS) withXattrTarget(i iref, byFD func(fd int) syscall.Errno, byPath func(path *byte) syscall.Errno) syscall.Errno {
	if i.isReg() || i.isDir() {
		fl := unix.O_RDONLY | unix.O_NONBLOCK
		if i.isDir() {
			fl |= unix.O_DIRECTORY
		}
		fd, errno := f.reopen(i, fl)
		if errno != 0 {
			return errno
		}
		defer sysClose(fd)
		return byFD(fd)
	}
	var b fdName
	p := procName(&b, i.fd)
	return f.onWorker(func() syscall.Errno { return byPath(p) })
}

// SetXAttr sets an extended attribute.
func (f *FS) SetXAttr(in *gofuse.SetXAttrIn, name, value []byte) syscall.Errno {
	if !f.opts.Xattr {
		return syscall.ENOSYS
	}
	if f.opts.ReadOnly {
		return syscall.EROFS
	}
	if len(value) > xattrSizeMax {
		return syscall.E2BIG
	}
	var cn cname
	p, errno := f.xattrName(name, &cn)
	if errno != 0 {
		return errno
	}
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	flags := int(in.Flags)
	killSGID := in.SetXAttrFlags&gofuse.SETXATTR_ACL_KILL_SGID != 0 &&
		bytes.Equal(name, []byte("system.posix_acl_access"))
	return f.withXattrTarget(i, func(fd int) syscall.Errno {
		if e := sysFsetxattr(fd, p, value, flags); e != 0 {
			return e
		}
		if killSGID {
			// What the kernel does for a caller outside the owning
			// group without CAP_FSETID; the guest decided it.
			var st syscall.Stat_t
			if sysFstat(fd, &st) == 0 && st.Mode&unix.S_ISGID != 0 {
				return sysFchmod(fd, st.Mode&0o7777&^unix.S_ISGID)
			}
		}
		return 0
	}, func(path *byte) syscall.Errno {
		return sysSetxattr(path, p, value, flags)
	})
}

// GetXAttr reads an extended attribute into dst (size query when dst is
// empty).
func (f *FS) GetXAttr(h *gofuse.InHeader, name []byte, dst []byte) (int, syscall.Errno) {
	if !f.opts.Xattr {
		return 0, syscall.ENOSYS
	}
	var cn cname
	p, errno := f.xattrName(name, &cn)
	if errno == syscall.EPERM {
		errno = syscall.ENODATA // a name the map refuses does not exist (as in the C daemon)
	}
	if errno != 0 {
		return 0, errno
	}
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return 0, errno
	}
	defer i.put()
	var n int
	errno = f.withXattrTarget(i, func(fd int) syscall.Errno {
		var e syscall.Errno
		n, e = sysFgetxattr(fd, p, dst)
		return e
	}, func(path *byte) syscall.Errno {
		var e syscall.Errno
		n, e = sysGetxattr(path, p, dst)
		return e
	})
	return n, errno
}

// ListXAttr lists attribute names into dst (size query when dst is empty).
func (f *FS) ListXAttr(h *gofuse.InHeader, dst []byte) (int, syscall.Errno) {
	if !f.opts.Xattr {
		return 0, syscall.ENOSYS
	}
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return 0, errno
	}
	defer i.put()
	var n int
	list := func(b []byte) syscall.Errno {
		return f.withXattrTarget(i, func(fd int) syscall.Errno {
			var e syscall.Errno
			n, e = sysFlistxattr(fd, b)
			return e
		}, func(path *byte) syscall.Errno {
			var e syscall.Errno
			n, e = sysListxattr(path, b)
			return e
		})
	}
	if f.xmap == nil && f.aclOn() {
		errno = list(dst)
		return n, errno
	}
	// Read the whole host list, then filter it.
	for range 8 {
		if errno = list(nil); errno != 0 {
			return 0, errno
		}
		all := make([]byte, n)
		if n > 0 {
			if errno = list(all); errno == syscall.ERANGE {
				continue
			} else if errno != 0 {
				return 0, errno
			}
		}
		out := f.filterXattrList(all[:n])
		if len(dst) == 0 {
			return len(out), 0
		}
		if len(out) > len(dst) {
			return 0, syscall.ERANGE
		}
		return copy(dst, out), 0
	}
	return 0, syscall.ERANGE
}

// filterXattrList maps host names back for the guest and hides the ones it
// must not see.
func (f *FS) filterXattrList(all []byte) []byte {
	out := make([]byte, 0, len(all))
	for len(all) > 0 {
		n := bytes.IndexByte(all, 0)
		if n < 0 {
			n = len(all)
		}
		name := all[:n]
		all = all[min(n+1, len(all)):]
		if len(name) == 0 {
			continue
		}
		if !f.aclOn() && bytes.HasPrefix(name, aclPrefix) {
			continue
		}
		if f.xmap != nil {
			var ok bool
			if name, ok = f.xmap.toGuest(name); !ok {
				continue
			}
		}
		out = append(out, name...)
		out = append(out, 0)
	}
	return out
}

// RemoveXAttr removes an extended attribute.
func (f *FS) RemoveXAttr(h *gofuse.InHeader, name []byte) syscall.Errno {
	if !f.opts.Xattr {
		return syscall.ENOSYS
	}
	if f.opts.ReadOnly {
		return syscall.EROFS
	}
	var cn cname
	p, errno := f.xattrName(name, &cn)
	if errno != 0 {
		return errno
	}
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	return f.withXattrTarget(i, func(fd int) syscall.Errno {
		return sysFremovexattr(fd, p)
	}, func(path *byte) syscall.Errno {
		return sysRemovexattr(path, p)
	})
}

// --- locks ---

// POSIX locks are emulated with OFD locks on one open file description per
// (inode, guest lock owner), as the C daemon does: locks of one owner merge
// and those of different owners conflict, as POSIX requires, and FLUSH
// (close(2) in the guest) drops all of the owner's locks on the file by
// closing that description. The number of owners held at once is bounded
// by Options.MaxLocks (ENOLCK beyond).
//
// A blocking SETLKW must not block a queue (the guest never interrupts it,
// and a stopped ring must be able to drain): it is tried once without
// waiting; if the lock is taken, the guest gets EAGAIN instead of waiting.
// (The C daemon answered every SETLKW with EOPNOTSUPP; here an uncontended
// SETLKW succeeds.)

// posixLocks is an inode's POSIX lock state: one open file description
// per lock owner. An inode gets one at its first lock (most never have
// one, and a million inodes would otherwise carry a million mutexes).
type posixLocks struct {
	mu  sync.Mutex
	fds map[uint64]int
}

func (f *FS) lockFD(i *inode, owner uint64, create bool) (int, syscall.Errno) {
	l := i.locks.Load()
	if l == nil {
		if !create {
			return -1, 0
		}
		i.locks.CompareAndSwap(nil, &posixLocks{}) // unless another request made it first
		l = i.locks.Load()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if fd, ok := l.fds[owner]; ok {
		return fd, 0
	}
	if !create {
		return -1, 0
	}
	if f.locks.Add(1) > f.maxLocks {
		f.locks.Add(-1)
		return -1, syscall.ENOLCK
	}
	r, errno := f.pathOf(i)
	if errno != 0 {
		f.locks.Add(-1)
		return -1, errno
	}
	defer r.put()
	fd, errno := f.reopen(r, unix.O_RDWR|unix.O_NONBLOCK)
	if errno == syscall.EACCES || errno == syscall.EROFS || errno == syscall.EISDIR {
		fd, errno = f.reopen(r, unix.O_RDONLY|unix.O_NONBLOCK)
	}
	if errno != 0 {
		f.locks.Add(-1)
		return -1, errno
	}
	if l.fds == nil {
		l.fds = make(map[uint64]int)
	}
	l.fds[owner] = fd
	return fd, 0
}

func (f *FS) dropLockOwner(i *inode, owner uint64) {
	l := i.locks.Load()
	if l == nil {
		return
	}
	l.mu.Lock()
	fd, ok := l.fds[owner]
	if ok {
		delete(l.fds, owner)
	}
	l.mu.Unlock()
	if ok {
		sysClose(fd)
		f.locks.Add(-1)
	}
}

// dropLocks closes every lock owner's file description on i (its last
// reference went, or the session was reset).
func (f *FS) dropLocks(i *inode) {
	l := i.locks.Load()
	if l == nil {
		return
	}
	l.mu.Lock()
	for _, fd := range l.fds {
		sysClose(fd)
		f.locks.Add(-1)
	}
	l.fds = nil
	l.mu.Unlock()
}

func toFlock(lk *gofuse.FileLock, fl *unix.Flock_t) syscall.Errno {
	const offsetMax = 1<<63 - 1
	if lk.Start > offsetMax || lk.End > offsetMax || lk.End < lk.Start {
		return syscall.EINVAL
	}
	*fl = unix.Flock_t{Type: int16(lk.Typ), Whence: unix.SEEK_SET, Start: int64(lk.Start)}
	if lk.End != offsetMax {
		fl.Len = int64(lk.End - lk.Start + 1)
	}
	switch lk.Typ {
	case unix.F_RDLCK, unix.F_WRLCK, unix.F_UNLCK:
	default:
		return syscall.EINVAL
	}
	return 0
}

// GetLk tests for a conflicting POSIX lock.
func (f *FS) GetLk(in *gofuse.LkIn, out *gofuse.LkOut) syscall.Errno {
	if !f.opts.PosixLocks || in.LkFlags&gofuse.LK_FLOCK != 0 {
		return syscall.ENOSYS
	}
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return errno
	}
	defer h.put()
	var fl unix.Flock_t
	if errno = toFlock(&in.Lk, &fl); errno != 0 {
		return errno
	}
	fd, errno := f.lockFD(h.ino, in.Owner, true)
	if errno != 0 {
		return errno
	}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &fl); err != nil {
		return toErrno(err)
	}
	out.Lk = gofuse.FileLock{Typ: uint32(fl.Type)}
	if fl.Type != unix.F_UNLCK {
		out.Lk.Start = uint64(fl.Start)
		if fl.Len == 0 {
			out.Lk.End = 1<<63 - 1
		} else {
			out.Lk.End = uint64(fl.Start + fl.Len - 1)
		}
		// OFD locks have no owning process (l_pid is -1).
		if fl.Pid > 0 {
			out.Lk.Pid = uint32(fl.Pid)
		}
	}
	return 0
}

// SetLk sets or clears a POSIX lock, or a flock lock with FUSE_LK_FLOCK,
// never waiting (see above).
func (f *FS) SetLk(in *gofuse.LkIn, wait bool) syscall.Errno {
	flock := in.LkFlags&gofuse.LK_FLOCK != 0
	if flock && !f.opts.Flock || !flock && !f.opts.PosixLocks {
		return syscall.ENOSYS
	}
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return errno
	}
	defer h.put()
	if flock {
		var op int
		switch in.Lk.Typ {
		case unix.F_RDLCK:
			op = unix.LOCK_SH
		case unix.F_WRLCK:
			op = unix.LOCK_EX
		case unix.F_UNLCK:
			op = unix.LOCK_UN
		default:
			return syscall.EINVAL
		}
		err := unix.Flock(h.fd, op|unix.LOCK_NB)
		if err == unix.EWOULDBLOCK {
			return syscall.EAGAIN
		}
		if err == nil {
			h.flocked.Store(op != unix.LOCK_UN)
		}
		return toErrno(err)
	}
	var fl unix.Flock_t
	if errno = toFlock(&in.Lk, &fl); errno != 0 {
		return errno
	}
	fd, errno := f.lockFD(h.ino, in.Owner, fl.Type != unix.F_UNLCK)
	if errno != 0 {
		return errno
	}
	if fd < 0 {
		return 0 // unlocking an owner that holds nothing
	}
	err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_SETLK, &fl)
	if err == unix.EACCES {
		err = unix.EAGAIN
	}
	return toErrno(err)
}

const atStatxSyncType = 0x6000 // AT_STATX_SYNC_TYPE
