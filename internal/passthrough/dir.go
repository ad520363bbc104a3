package passthrough

import (
	"bytes"
	"encoding/binary"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// writableDir returns directory node, held, for a request that changes
// it: EROFS on a read-only share.
func (f *FS) writableDir(node uint64) (iref, syscall.Errno) {
	if f.opts.ReadOnly {
		return iref{}, syscall.EROFS
	}
	return f.getDir(node)
}

// dirToChange is writableDir for a request that makes or removes entry
// name, which it checks first.
func (f *FS) dirToChange(node uint64, name []byte) (iref, syscall.Errno) {
	if errno := checkName(name); errno != 0 {
		return iref{}, errno
	}
	return f.writableDir(node)
}

// createEntry runs mk (the creating *at call on dir) with the caller's
// credentials, labels the new object with sec (if not nil: secctx.go),
// then looks the new name up, filling out. rmdir says mk makes a
// directory.
func (f *FS) createEntry(h *gofuse.InHeader, groups []uint32, umask uint32, sec *SecCtx, rmdir bool, name []byte, out *gofuse.EntryOut,
	mk func(dirfd int, name *byte) syscall.Errno) syscall.Errno {
	dir, errno := f.dirToChange(h.NodeId, name)
	if errno != 0 {
		return errno
	}
	defer dir.put()
	var cn cname
	p := cn.set(name)
	errno = f.asCaller(h.Uid, h.Gid, groups, f.umaskFor(umask), func() syscall.Errno { return mk(dir.fd, p) })
	if errno != 0 {
		return errno
	}
	if sec != nil {
		if errno := f.labelName(dir.fd, p, sec, rmdir); errno != 0 {
			return errno
		}
	}
	return f.lookupName(dir, name, out)
}

// Mkdir creates a directory (groups: see asCaller).
func (f *FS) Mkdir(in *gofuse.MkdirIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.EntryOut) syscall.Errno {
	return f.createEntry(&in.InHeader, groups, in.Umask, sec, true, name, out, func(dirfd int, p *byte) syscall.Errno {
		return sysMkdirat(dirfd, p, in.Mode&0o7777)
	})
}

// Mknod creates a special file or a regular file.
func (f *FS) Mknod(in *gofuse.MknodIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.EntryOut) syscall.Errno {
	return f.createEntry(&in.InHeader, groups, in.Umask, sec, false, name, out, func(dirfd int, p *byte) syscall.Errno {
		return sysMknodat(dirfd, p, in.Mode, uint64(in.Rdev))
	})
}

// Symlink creates name in h.NodeId pointing to target (never followed).
func (f *FS) Symlink(h *gofuse.InHeader, groups []uint32, sec *SecCtx, target, name []byte, out *gofuse.EntryOut) syscall.Errno {
	if len(target) == 0 || bytes.IndexByte(target, 0) >= 0 {
		return syscall.EINVAL
	}
	if len(target) >= 4096 {
		return syscall.ENAMETOOLONG
	}
	t := make([]byte, len(target)+1)
	copy(t, target)
	return f.createEntry(h, groups, 0, sec, false, name, out, func(dirfd int, p *byte) syscall.Errno {
		return sysSymlinkat(&t[0], dirfd, p)
	})
}

func (f *FS) removeName(h *gofuse.InHeader, name []byte, flags int) syscall.Errno {
	dir, errno := f.dirToChange(h.NodeId, name)
	if errno != 0 {
		return errno
	}
	defer dir.put()
	var cn cname
	p := cn.set(name)
	if !f.mayTrack() {
		return sysUnlinkat(dir.fd, p, flags)
	}
	if errno, done := f.untracked(func() syscall.Errno { return sysUnlinkat(dir.fd, p, flags) }); done {
		return errno
	}
	return f.removeTracked(dir, name, p, flags)
}

// Unlink removes a non-directory.
func (f *FS) Unlink(h *gofuse.InHeader, name []byte) syscall.Errno {
	return f.removeName(h, name, 0)
}

// Rmdir removes a directory.
func (f *FS) Rmdir(h *gofuse.InHeader, name []byte) syscall.Errno {
	return f.removeName(h, name, unix.AT_REMOVEDIR)
}

// Rename moves h.NodeId/oldName to newDir/newName.
func (f *FS) Rename(h *gofuse.InHeader, newDir uint64, flags uint32, oldName, newName []byte) syscall.Errno {
	if errno := checkName(oldName); errno != 0 {
		return errno
	}
	if errno := checkName(newName); errno != 0 {
		return errno
	}
	if flags&^(unix.RENAME_NOREPLACE|unix.RENAME_EXCHANGE|unix.RENAME_WHITEOUT) != 0 {
		return syscall.EINVAL
	}
	od, errno := f.writableDir(h.NodeId)
	if errno != 0 {
		return errno
	}
	defer od.put()
	nd, errno := f.getDir(newDir)
	if errno != 0 {
		return errno
	}
	defer nd.put()
	var on, nn cname
	op, np := on.set(oldName), nn.set(newName)
	if !f.mayTrack() {
		return sysRenameat2(od.fd, op, nd.fd, np, flags)
	}
	if errno, done := f.untracked(func() syscall.Errno { return sysRenameat2(od.fd, op, nd.fd, np, flags) }); done {
		return errno
	}
	return f.renameTracked(od, nd, oldName, newName, op, np, flags)
}

// Link makes a new name for in.Oldnodeid in directory in.NodeId.
func (f *FS) Link(in *gofuse.LinkIn, name []byte, out *gofuse.EntryOut) syscall.Errno {
	if errno := checkName(name); errno != 0 {
		return errno
	}
	if f.opts.ReadOnly {
		return syscall.EROFS
	}
	src, errno := f.getInode(in.Oldnodeid)
	if errno != 0 {
		return errno
	}
	defer src.put()
	dir, errno := f.getDir(in.NodeId)
	if errno != 0 {
		return errno
	}
	defer dir.put()
	if src.isDir() {
		return syscall.EPERM
	}
	var cn cname
	p := cn.set(name)
	// linkat(fd, "", AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH; the
	// /proc/self/fd magic link works without it (and for O_TMPFILE files).
	var b fdName
	if errno = sysLinkat(f.procSelfFD, procName(&b, src.fd), dir.fd, p, unix.AT_SYMLINK_FOLLOW); errno != 0 {
		return errno
	}
	return f.lookupName(dir, name, out)
}

// Readlink reads the target of symlink h.NodeId into buf.
func (f *FS) Readlink(h *gofuse.InHeader, buf []byte) (int, syscall.Errno) {
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return 0, errno
	}
	defer i.put()
	if !i.isSymlink() {
		return 0, syscall.EINVAL
	}
	return sysReadlinkat(i.fd, &emptyPath[0], buf)
}

// OpenDir opens directory in.NodeId.
func (f *FS) OpenDir(in *gofuse.OpenIn, out *gofuse.OpenOut) syscall.Errno {
	i, errno := f.getInode(in.NodeId)
	if errno != 0 {
		return errno
	}
	if !i.isDir() {
		i.put()
		return syscall.ENOTDIR
	}
	fd, errno := f.reopen(i, unix.O_RDONLY|unix.O_DIRECTORY)
	if errno != 0 {
		i.put()
		return errno
	}
	return f.openOut(i, fd, handleDir, unix.O_RDONLY, out)
}

// openOut registers fd, opened from i, as a handle of kind and fills out
// (OPEN, OPENDIR, CREATE). It takes over fd and i's use reference.
func (f *FS) openOut(i iref, fd int, kind handleKind, flags int, out *gofuse.OpenOut) syscall.Errno {
	i.closePath()
	h, errno := f.newHandle(i.inode, fd, kind, flags)
	if errno != 0 {
		return errno
	}
	fl := f.fileOpenFlags()
	if kind == handleDir {
		fl = f.dirOpenFlags()
	}
	*out = gofuse.OpenOut{Fh: h.id, OpenFlags: fl}
	return 0
}

// newHandle registers an open fd; it takes over fd and the caller's use
// reference on i.
func (f *FS) newHandle(i *inode, fd int, kind handleKind, flags int) (*handle, syscall.Errno) {
	h := &handle{fd: fd, ino: i, kind: kind, flags: flags, wait: bufvec.MayWait}
	i.handles.Add(1)
	h.countWriter()
	if kind == handleDir {
		h.dir = &dirStream{}
	} else {
		h.wait = i.fileWait(fd)
	}
	h.refs.Store(1)
	f.handleFDs.Add(1)
	if !f.handles.insert(f.rr.Add(1), h) {
		h.put()
		return nil, syscall.ENFILE
	}
	return h, 0
}

// countWriter counts h in its inode's writers if it is a file open for
// writing.
func (h *handle) countWriter() {
	if h.kind == handleFile && h.flags&unix.O_ACCMODE != unix.O_RDONLY {
		h.writer = true
		h.ino.writers.Add(1)
	}
}

// ReleaseDir closes a directory handle.
func (f *FS) ReleaseDir(in *gofuse.ReleaseIn) {
	f.release(in.Fh, handleDir)
}

func (f *FS) release(fh uint64, kind handleKind) *handle {
	h := f.handles.get(fh)
	if h == nil || h.kind != kind || !f.handles.remove(fh) {
		return nil
	}
	h.put()
	return h
}

// FsyncDir syncs a directory handle.
func (f *FS) FsyncDir(in *gofuse.FsyncIn) syscall.Errno {
	h, errno := f.getHandle(in.Fh, handleDir)
	if errno != 0 {
		return errno
	}
	defer h.put()
	return fsyncFD(h.fd, in.FsyncFlags)
}

const dirBufSize = 32 << 10

// ReadDir lists a directory from the guest's offset (a d_off cookie).
func (f *FS) ReadDir(in *gofuse.ReadIn, plus bool, emit func(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool)) syscall.Errno {
	h, errno := f.getHandle(in.Fh, handleDir)
	if errno != 0 {
		return errno
	}
	defer h.put()
	if h.ino.id != in.NodeId {
		return syscall.EBADF
	}
	d := h.dir
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.buf == nil {
		d.buf = make([]byte, dirBufSize)
	}
	if in.Offset != d.next {
		if _, e := sysLseek(h.fd, int64(in.Offset), unix.SEEK_SET); e != 0 {
			return e
		}
		d.pos, d.end, d.next = 0, 0, in.Offset
	}
	emitted := false
	for {
		if d.pos >= d.end {
			n, e := sysGetdents(h.fd, d.buf)
			if e != 0 {
				if emitted {
					return 0
				}
				return e
			}
			if n == 0 {
				return 0
			}
			d.pos, d.end = 0, n
		}
		rec := d.buf[d.pos:d.end]
		ent, ok := parseDirent(rec)
		if !ok {
			d.pos = d.end // corrupt; refill
			continue
		}
		typ := uint32(ent.typ) << 12
		if len(ent.name) == 0 {
			d.pos += ent.reclen
			d.next = ent.off
			continue
		}
		eo, ok := emit(ent.name, ent.ino, typ, ent.off)
		if !ok {
			return 0
		}
		emitted = true
		if plus && eo != nil {
			if isDotOrDotDot(ent.name) || f.plusLookup(h, ent.name, &rec[direntNameOff], eo) != 0 {
				*eo = gofuse.EntryOut{}
				eo.Ino = ent.ino
				eo.Mode = typ
			}
		}
		d.pos += ent.reclen
		d.next = ent.off
	}
}

// dirent64 is one record of a getdents64 buffer (struct linux_dirent64).
type dirent64 struct {
	ino    uint64
	off    uint64 // the d_off cookie of the next entry
	typ    uint8  // DT_*
	name   []byte // up to its NUL
	reclen int
}

// direntNameOff is where a linux_dirent64's NUL-terminated name starts.
const direntNameOff = 19

// parseDirent parses the record at the start of buf: false when buf is
// too short for one or the record's length does not fit (corrupt).
func parseDirent(buf []byte) (dirent64, bool) {
	if len(buf) < direntNameOff {
		return dirent64{}, false
	}
	reclen := int(binary.LittleEndian.Uint16(buf[16:]))
	if reclen < direntNameOff || reclen > len(buf) {
		return dirent64{}, false
	}
	name := buf[direntNameOff:reclen]
	if n := bytes.IndexByte(name, 0); n >= 0 {
		name = name[:n]
	}
	return dirent64{
		ino:    binary.LittleEndian.Uint64(buf),
		off:    binary.LittleEndian.Uint64(buf[8:]),
		typ:    buf[18],
		name:   name,
		reclen: reclen,
	}, true
}

// plusLookup looks up a READDIRPLUS entry by its name, cname its
// NUL-terminated copy in the getdents buffer.
func (f *FS) plusLookup(dir *handle, name []byte, cname *byte, out *gofuse.EntryOut) syscall.Errno {
	fd, errno := f.openChild(dir.fd, cname)
	if errno != 0 {
		return errno
	}
	return f.internFD(fd, dir.ino, name, out)
}

func fsyncFD(fd int, flags uint32) syscall.Errno {
	var err error
	if flags&1 != 0 { // FUSE_FSYNC_FDATASYNC
		err = unix.Fdatasync(fd)
	} else {
		err = unix.Fsync(fd)
	}
	return toErrno(err)
}
