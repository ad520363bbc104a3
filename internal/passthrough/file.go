package passthrough

import (
	"errors"
	"math"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// hostOpenFlags turns the guest's open flags into the flags for the host
// open, as the C daemon's update_open_flags does:
//   - flags that would change what is opened or how (O_CREAT, O_EXCL,
//     O_NOCTTY, O_NOFOLLOW — the reopen goes through a /proc magic link —,
//     O_PATH, O_TMPFILE, O_DIRECTORY handled by the caller) are dropped;
//   - with the writeback cache the guest kernel may read through a
//     write-only open and handles O_APPEND itself: O_WRONLY becomes O_RDWR
//     and O_APPEND is dropped;
//   - O_DIRECT is kept only with allow_direct_io;
//   - O_NOATIME is kept only with preserve_noatime (it fails with EPERM
//     for files the daemon does not own without CAP_FOWNER).
func (f *FS) hostOpenFlags(guest uint32) int {
	return f.hostOpenFlagsWB(guest, f.writeback.Load())
}

// hostOpenFlagsWB is hostOpenFlags for a session with writeback cache or
// not (LoadState reopens handles before it installs the session).
func (f *FS) hostOpenFlagsWB(guest uint32, writeback bool) int {
	fl := int(guest)
	fl &^= unix.O_CREAT | unix.O_EXCL | unix.O_NOCTTY | unix.O_NOFOLLOW | unix.O_PATH |
		unix.O_TMPFILE | unix.O_DIRECTORY | unix.O_CLOEXEC | unix.O_ASYNC
	if writeback {
		if fl&unix.O_ACCMODE == unix.O_WRONLY {
			fl = fl&^unix.O_ACCMODE | unix.O_RDWR
		}
		fl &^= unix.O_APPEND
	}
	if !f.opts.AllowDirectIO {
		fl &^= unix.O_DIRECT
	}
	if !f.opts.PreserveNoatime {
		fl &^= unix.O_NOATIME
	}
	return fl | unix.O_CLOEXEC
}

func writes(fl int) bool {
	return fl&unix.O_ACCMODE != unix.O_RDONLY || fl&unix.O_TRUNC != 0
}

// Open opens in.NodeId, which must be a regular file (or a directory):
// FIFOs, sockets and device nodes are never opened (CVE-2020-35517).
func (f *FS) Open(in *gofuse.OpenIn, out *gofuse.OpenOut) syscall.Errno {
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	fl := f.hostOpenFlags(in.Flags)
	if f.opts.ReadOnly && writes(fl) {
		i.put()
		return syscall.EROFS
	}
	if i.isDir() {
		fl |= unix.O_DIRECTORY
	}
	fd, errno := f.reopen(i, fl)
	if errno != 0 {
		i.put()
		return errno
	}
	if fl&unix.O_TRUNC != 0 && in.Mode&gofuse.OPEN_KILL_SUIDGID != 0 {
		if errno = f.killPriv(fd, false); errno != 0 {
			sysClose(fd)
			i.put()
			return errno
		}
	}
	return f.openOut(i, fd, handleFile, fl, out)
}

// Create creates and opens name in in.NodeId with O_CREAT|O_EXCL as the
// caller; an existing file is opened instead (as an OPEN would) unless the
// guest asked for O_EXCL.
func (f *FS) Create(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.CreateOut) syscall.Errno {
	dir, errno := f.dirToChange(in.NodeId, name)
	if errno != 0 {
		return errno
	}
	defer dir.put()
	fl := f.hostOpenFlags(in.Flags)
	var cn cname
	p := cn.set(name)
	fd, errno := -1, errNoTmpfile
	if sec != nil {
		fd, errno = f.createLabelled(in, groups, sec, dir.fd, p, fl)
	}
	if errno == errNoTmpfile {
		fd, errno = f.openAsCaller(in, groups, dir.fd, p, fl|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW)
		if errno == 0 && sec != nil {
			if errno = f.labelFD(fd, sec); errno != 0 {
				sysClose(fd)
				sysUnlinkat(dir.fd, p, 0)
			}
		}
	}
	if errno == syscall.EEXIST && in.Flags&unix.O_EXCL == 0 {
		// Not created here: it keeps its label.
		return f.createOpenExisting(dir, name, fl, in.OpenFlags, out)
	}
	if errno != 0 {
		return errno
	}
	return f.finishCreate(fd, fl, dir, name, out)
}

// errNoTmpfile is createLabelled's answer where the file system makes no
// O_TMPFILE (EOPNOTSUPP; EISDIR from a kernel that does not know it).
const errNoTmpfile = syscall.Errno(^uintptr(0) - 1)

// createLabelled creates name in dirfd as in's caller with its label sec
// already set, and opens it with host flags fl: an O_TMPFILE made as the
// caller, labelled while it has no name, then linked under name (EEXIST
// if it exists). No one, on the host or in the guest, ever sees name
// unlabelled, and a failed labelling leaves nothing behind. The link is
// the daemon's, as LINK's is: the O_TMPFILE already needed the caller's
// write access to the directory.
func (f *FS) createLabelled(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, dirfd int, p *byte, fl int) (int, syscall.Errno) {
	tfl := fl&^(unix.O_ACCMODE|unix.O_TRUNC) | unix.O_RDWR | unix.O_TMPFILE // no O_EXCL: it must be linkable
	fd, errno := f.openAsCaller(in, groups, dirfd, &dotPath[0], tfl)
	switch errno {
	case 0:
	case syscall.EOPNOTSUPP, syscall.EISDIR:
		return -1, errNoTmpfile
	default:
		return -1, errno
	}
	var b fdName
	tmp := procName(&b, fd)
	hfd := fd // the handle's fd
	errno = f.labelFD(fd, sec)
	if errno == 0 && fl&unix.O_ACCMODE != unix.O_RDWR {
		// O_TMPFILE needs write access; the handle gets the guest's,
		// reopened before the link so that nothing has to be undone
		// once the name exists.
		hfd, errno = f.withFDs(true, func() (int, syscall.Errno) {
			return sysOpenat(f.procSelfFD, tmp, fl|unix.O_CLOEXEC, 0)
		})
	}
	if errno == 0 {
		errno = sysLinkat(f.procSelfFD, tmp, dirfd, p, unix.AT_SYMLINK_FOLLOW)
	}
	if hfd != fd {
		sysClose(fd) // the handle has its own fd (or its reopen failed)
	}
	if errno != 0 {
		if hfd >= 0 {
			sysClose(hfd) // unnamed: the file goes with its last fd
		}
		return -1, errno
	}
	return hfd, 0
}

// createOpenExisting handles CREATE of a name that exists: look it up, then
// open it like OPEN (regular files only).
func (f *FS) createOpenExisting(dir iref, name []byte, fl int, openFlags uint32, out *gofuse.CreateOut) syscall.Errno {
	if errno := f.lookupName(dir, name, &out.EntryOut); errno != 0 {
		return errno
	}
	i, errno := f.getInode(out.NodeId)
	if errno != 0 {
		return errno
	}
	fd := -1
	switch {
	case i.isDir():
		errno = syscall.EISDIR
	case i.isSymlink():
		errno = syscall.ELOOP
	default:
		fd, errno = f.reopen(i, fl)
	}
	if errno == 0 && fl&unix.O_TRUNC != 0 && openFlags&gofuse.OPEN_KILL_SUIDGID != 0 {
		if errno = f.killPriv(fd, false); errno != 0 {
			sysClose(fd)
		}
	}
	if errno != 0 {
		i.put()
		f.forget(i.inode, 1) // the lookup taken above
		return errno
	}
	ino := i.inode
	if errno = f.openOut(i, fd, handleFile, fl, &out.OpenOut); errno != 0 {
		f.forget(ino, 1)
		return errno
	}
	if fl&unix.O_TRUNC != 0 {
		// The entry's attributes were read before the truncation.
		var st unix.Statx_t
		if statxFD(fd, &st) == 0 {
			f.guestAttr(&out.Attr, &st)
			f.setAttrDAX(ino, &out.Attr)
		}
	}
	return 0
}

// finishCreate turns a freshly created open fd into an inode (through an
// O_PATH reopen of the very same file, so a concurrent rename cannot swap
// in another object) plus a handle. name is the file's name in dir (nil: an
// O_TMPFILE).
func (f *FS) finishCreate(fd int, fl int, dir iref, name []byte, out *gofuse.CreateOut) syscall.Errno {
	var b fdName
	pfd, errno := sysOpenat(f.procSelfFD, procName(&b, fd), unix.O_PATH|unix.O_CLOEXEC, 0)
	if errno != 0 {
		sysClose(fd)
		return errno
	}
	f.inodeFDs.Add(1)
	if errno = f.internFD(pfd, dir.inode, name, &out.EntryOut); errno != 0 {
		sysClose(fd)
		return errno
	}
	i := f.nodes.get(out.NodeId)
	if i == nil || !i.tryRef() {
		sysClose(fd)
		return syscall.ENOENT
	}
	// A file created in dir (O_EXCL or O_TMPFILE: never a mount point)
	// lives on dir's file system.
	i.inheritWait(dir.inode, dir.fd)
	h, errno := f.newHandle(i, fd, handleFile, fl)
	if errno != 0 {
		f.forget(i, 1)
		return errno
	}
	out.OpenOut = gofuse.OpenOut{Fh: h.id, OpenFlags: f.fileOpenFlags()}
	return 0
}

// Tmpfile creates an unnamed regular file (O_TMPFILE) in in.NodeId.
func (f *FS) Tmpfile(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, out *gofuse.CreateOut) syscall.Errno {
	dir, errno := f.writableDir(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer dir.put()
	fl := f.hostOpenFlags(in.Flags) &^ unix.O_TRUNC
	if fl&unix.O_ACCMODE == unix.O_RDONLY {
		fl |= unix.O_RDWR // O_TMPFILE needs write access
	}
	fl |= int(in.Flags) & unix.O_EXCL // with O_TMPFILE: never linkable
	fd, errno := f.openAsCaller(in, groups, dir.fd, &dotPath[0], fl|unix.O_TMPFILE)
	if errno != 0 {
		return errno
	}
	if sec != nil {
		if errno := f.labelFD(fd, sec); errno != 0 {
			sysClose(fd) // unnamed: it goes with its last fd
			return errno
		}
	}
	return f.finishCreate(fd, fl, dir, nil, out)
}

// openAsCaller opens name in dirfd with host flags fl as in's caller (its
// ids, supplementary groups and umask), creating it with in's mode.
// Out of fds, it sheds inode fds and tries once more (outOfFDs): the fd is
// allocated before the name is resolved, so the failed try created nothing.
func (f *FS) openAsCaller(in *gofuse.CreateIn, groups []uint32, dirfd int, name *byte, fl int) (int, syscall.Errno) {
	return f.withFDs(true, func() (int, syscall.Errno) {
		fd := -1
		errno := f.asCaller(in.Uid, in.Gid, groups, f.umaskFor(in.Umask), func() syscall.Errno {
			var e syscall.Errno
			fd, e = sysOpenat(dirfd, name, fl, in.Mode&0o7777)
			return e
		})
		return fd, errno
	})
}

func (f *FS) fileHandle(fh, node uint64) (*handle, syscall.Errno) {
	h, errno := f.getHandle(fh, handleFile)
	if errno != 0 {
		return nil, errno
	}
	if h.ino.id != node {
		h.put()
		return nil, syscall.EBADF
	}
	return h, 0
}

func ioErrno(err error) syscall.Errno {
	switch {
	case err == nil:
		return 0
	case err == bufvec.ErrUnmapped:
		return syscall.EFAULT
	case err == bufvec.ErrShort:
		return syscall.EINVAL
	}
	if e, ok := err.(syscall.Errno); ok {
		return e
	}
	if errors.Is(err, bufvec.ErrUnmapped) {
		return syscall.EFAULT
	}
	return syscall.EIO
}

// Read reads up to in.Size bytes at in.Offset into dst with one preadv.
//
// Read and Write stop at the first segment that is not mapped into the
// daemon and return the bytes done with EFAULT (a short read would look
// like end of file to the guest); the server can continue from there
// through the VMM with WithHandleFD.
func (f *FS) Read(in *gofuse.ReadIn, dst *bufvec.Vec) (int, syscall.Errno) {
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return 0, errno
	}
	n, err := dst.ReadFrom(h.fd, int64(in.Offset), min(int(in.Size), dst.Len()), h.wait)
	h.put()
	return ioResult(n, err)
}

// ioResult is the answer of a READ or WRITE that did n bytes and met err:
// the bytes done, with EFAULT at a segment not mapped into the daemon (the
// server goes on from there through the VMM); an error only when nothing
// was done.
func ioResult(n int, err error) (int, syscall.Errno) {
	if err == bufvec.ErrUnmapped {
		return n, syscall.EFAULT
	}
	if err != nil && n == 0 {
		return 0, ioErrno(err)
	}
	return n, 0
}

// WithHandleFD runs fn with the host fd of open file fh of node nodeID,
// keeping the handle open meanwhile (for the FS_IO bounce path: the fd is
// sent to the VMM). fn must not close the fd.
func (f *FS) WithHandleFD(nodeID, fh uint64, fn func(fd int) syscall.Errno) syscall.Errno {
	h, errno := f.fileHandle(fh, nodeID)
	if errno != 0 {
		return errno
	}
	defer h.put()
	return fn(h.fd)
}

// Write writes in.Size bytes of src at in.Offset with one pwritev. With
// FUSE_WRITE_KILL_SUIDGID the file's set-user-ID bit (and set-group-ID if
// group-executable) is cleared first, as the kernel does before a write by a
// caller without CAP_FSETID.
func (f *FS) Write(in *gofuse.WriteIn, src *bufvec.Vec) (int, syscall.Errno) {
	if f.opts.ReadOnly {
		return 0, syscall.EROFS
	}
	if int(in.Size) > src.Len() {
		return 0, syscall.EINVAL
	}
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return 0, errno
	}
	if in.WriteFlags&gofuse.WRITE_KILL_SUIDGID != 0 {
		if errno = f.killPriv(h.fd, false); errno != 0 {
			h.put()
			return 0, errno
		}
	}
	if f.dax.on.Load() {
		n, err := f.writeMapped(h, in, src)
		h.put()
		return ioResult(n, err)
	}
	n, err := src.WriteTo(h.fd, int64(in.Offset), int(in.Size), h.wait)
	h.put()
	return ioResult(n, err)
}

// writeMapped is Write with a DAX window: the bytes written are copied into
// the file's tails too (dax.go). An O_APPEND handle writes at the end
// whatever the offset: then every tail is written back and refreshed.
func (f *FS) writeMapped(h *handle, in *gofuse.WriteIn, src *bufvec.Vec) (int, error) {
	nt := h.ino.lockTails()
	off, span := in.Offset, uint64(0)
	if h.flags&unix.O_APPEND != 0 {
		h.ino.writeBackTails(nt, true)
		off, span = 0, math.MaxUint64
	}
	n, err := src.WriteTo(h.fd, int64(in.Offset), int(in.Size), h.wait)
	if span == 0 {
		span = uint64(max(n, 0))
	}
	h.ino.tailsChanged(nt, off, span)
	return n, err
}

// Flush is called on every close of a guest fd: drop the lock owner's
// POSIX locks and close a dup of the fd (which reports deferred write
// errors on file systems such as NFS), as the C daemon does.
func (f *FS) Flush(in *gofuse.FlushIn) syscall.Errno {
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return errno
	}
	defer h.put()
	f.dropLockOwner(h.ino, in.LockOwner)
	if errno := h.ino.writeBackTails(h.ino.tails.Load(), false); errno != 0 {
		return errno
	}
	fd, err := unix.Dup(h.fd)
	if err != nil {
		return toErrno(err)
	}
	return toErrno(unix.Close(fd))
}

// Release closes a file handle.
func (f *FS) Release(in *gofuse.ReleaseIn) {
	if h := f.release(in.Fh, handleFile); h != nil {
		h.ino.writeBackTails(h.ino.tails.Load(), false)
	}
}

// Fsync syncs a file handle (fdatasync with FUSE_FSYNC_FDATASYNC).
func (f *FS) Fsync(in *gofuse.FsyncIn) syscall.Errno {
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return errno
	}
	defer h.put()
	if errno := h.ino.writeBackTails(h.ino.tails.Load(), false); errno != 0 {
		return errno
	}
	return fsyncFD(h.fd, in.FsyncFlags)
}

// Fallocate allocates or punches space.
func (f *FS) Fallocate(in *gofuse.FallocateIn) syscall.Errno {
	if f.opts.ReadOnly {
		return syscall.EROFS
	}
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return errno
	}
	defer h.put()
	if int64(in.Offset) < 0 || int64(in.Length) <= 0 {
		return syscall.EINVAL
	}
	if f.dax.on.Load() {
		// Collapsing and inserting ranges move the bytes after them:
		// the tails are refreshed from the offset on.
		nt := h.ino.lockTails()
		h.ino.writeBackTails(nt, true)
		errno := toErrno(unix.Fallocate(h.fd, in.Mode, int64(in.Offset), int64(in.Length)))
		h.ino.tailsChanged(nt, in.Offset, math.MaxUint64)
		return errno
	}
	return toErrno(unix.Fallocate(h.fd, in.Mode, int64(in.Offset), int64(in.Length)))
}

// Lseek finds data or holes (SEEK_DATA/SEEK_HOLE).
func (f *FS) Lseek(in *gofuse.LseekIn, out *gofuse.LseekOut) syscall.Errno {
	h, errno := f.fileHandle(in.Fh, in.NodeId)
	if errno != 0 {
		return errno
	}
	defer h.put()
	switch in.Whence {
	case unix.SEEK_SET, unix.SEEK_CUR, unix.SEEK_END, unix.SEEK_DATA, unix.SEEK_HOLE:
	default:
		return syscall.EINVAL
	}
	off, e := sysLseek(h.fd, int64(in.Offset), int(in.Whence))
	if e != 0 {
		return e
	}
	out.Offset = uint64(off)
	return 0
}
