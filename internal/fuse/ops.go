package fuse

import (
	"bytes"
	"encoding/binary"
	"syscall"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Each handler decodes its request from in (the cursor is just past the
// fuse_in_header), calls the file system and returns the reply payload's
// length: either in q.rbuf after the out header, or, when it sets q.direct,
// already written into out after the out header.

func (q *Queue) doRead(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.read
	if errno := q.readArgs(in, unsafe.Pointer(a), readInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if err := out.Seek(OutHeaderSize); err != nil {
		return 0, syscall.EINVAL
	}
	// The guest offers room for what it asked; never read more than the
	// room there is.
	if uint64(a.Size) > uint64(out.Len()) {
		a.Size = uint32(out.Len())
	}
	n, errno := q.s.fs.Read(a, out)
	if errno != 0 {
		return 0, errno
	}
	if n < 0 || n > int(a.Size) {
		return 0, syscall.EIO
	}
	q.direct = true
	return n, 0
}

func (q *Queue) doWrite(in, out *bufvec.Vec, sess *session) (int, syscall.Errno) {
	a := &q.a.write
	if errno := q.readArgs(in, unsafe.Pointer(a), writeInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	// The session's max_write: the one INIT told the guest, which a
	// migrated session keeps whatever this daemon's options say.
	if int(a.Size) != in.Len() || a.Size > sess.maxWrite || !room(out, writeOutSize) {
		return 0, syscall.EINVAL
	}
	n, errno := q.s.fs.Write(a, in)
	if errno != 0 {
		return 0, errno
	}
	if n < 0 || n > int(a.Size) {
		return 0, syscall.EIO
	}
	p := q.payload(writeOutSize)
	binary.LittleEndian.PutUint32(p[0:], uint32(n))
	binary.LittleEndian.PutUint32(p[4:], 0)
	return writeOutSize, 0
}

func (q *Queue) doGetattr(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.getattr
	if errno := q.readArgs(in, unsafe.Pointer(a), getattrInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, attrOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.attr = gofuse.AttrOut{}
	if errno := q.s.fs.GetAttr(a, &q.o.attr); errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.attr), attrOutSize), 0
}

func (q *Queue) doSetattr(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.setattr
	if errno := q.readArgs(in, unsafe.Pointer(a), setattrInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, attrOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.attr = gofuse.AttrOut{}
	if errno := q.s.fs.SetAttr(a, &q.o.attr); errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.attr), attrOutSize), 0
}

// entryReply copies q.o.entry into the reply after a successful call.
func (q *Queue) entryReply(errno syscall.Errno) (int, syscall.Errno) {
	if errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.entry), entryOutSize), 0
}

func (q *Queue) doLookup(in, out *bufvec.Vec) (int, syscall.Errno) {
	name, errno := q.restName(in)
	if errno != 0 {
		return 0, errno
	}
	if !room(out, entryOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.entry = gofuse.EntryOut{}
	return q.entryReply(q.s.fs.Lookup(&q.h, name, &q.o.entry))
}

func (q *Queue) doForget(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.forget
	if q.readArgs(in, unsafe.Pointer(a), forgetInSize, unsafe.Sizeof(*a)) == 0 {
		q.s.fs.Forget(a.NodeId, a.Nlookup)
	}
	return 0, noReply
}

func (q *Queue) doBatchForget(in *bufvec.Vec) (int, syscall.Errno) {
	var hdr [batchForgetSize]byte
	if in.ReadFull(hdr[:]) != nil {
		return 0, noReply
	}
	count := min(uint64(binary.LittleEndian.Uint32(hdr[:])), uint64(in.Len()/forgetOneSize))
	for range count {
		if in.ReadFull(q.forget[:]) != nil {
			break
		}
		q.s.fs.Forget(binary.LittleEndian.Uint64(q.forget[0:]), binary.LittleEndian.Uint64(q.forget[8:]))
	}
	return 0, noReply
}

func (q *Queue) doReadlink(out *bufvec.Vec) (int, syscall.Errno) {
	buf := q.replyScratch(maxLink)
	n, errno := q.s.fs.Readlink(&q.h, buf)
	if errno != 0 {
		return 0, errno
	}
	if n < 0 || n > len(buf) {
		return 0, syscall.EIO
	}
	if !room(out, n) {
		return 0, syscall.ENAMETOOLONG
	}
	return q.writeDirect(out, buf[:n])
}

// writeDirect writes a variable-length payload straight into out.
func (q *Queue) writeDirect(out *bufvec.Vec, p []byte) (int, syscall.Errno) {
	if err := out.Seek(OutHeaderSize); err != nil {
		return 0, syscall.EINVAL
	}
	if err := out.WriteFull(p); err != nil {
		return 0, argErr(err)
	}
	q.direct = true
	return len(p), 0
}

// replyScratch returns a scratch buffer of n bytes for a reply that is
// built before it is copied into out.
func (q *Queue) replyScratch(n int) []byte {
	if cap(q.dbuf) < n {
		q.dbuf = make([]byte, max(n, maxLink)) // at most twice per queue
	}
	return q.dbuf[:n]
}

func (q *Queue) doSymlink(in, out *bufvec.Vec) (int, syscall.Errno) {
	b, errno := q.rest(in)
	if errno != 0 {
		return 0, errno
	}
	// The kernel sends the new entry's name, then the link target.
	name, target, errno := twoNames(b)
	if errno != 0 {
		return 0, errno
	}
	if !room(out, entryOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.entry = gofuse.EntryOut{}
	return q.entryReply(q.s.fs.Symlink(&q.h, q.group, target, name, &q.o.entry))
}

func (q *Queue) doMknod(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.mknod
	if errno := q.readArgs(in, unsafe.Pointer(a), mknodInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	name, errno := q.restName(in)
	if errno != 0 {
		return 0, errno
	}
	if !room(out, entryOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.entry = gofuse.EntryOut{}
	return q.entryReply(q.s.fs.Mknod(a, q.group, name, &q.o.entry))
}

func (q *Queue) doMkdir(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.mkdir
	if errno := q.readArgs(in, unsafe.Pointer(a), mkdirInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	name, errno := q.restName(in)
	if errno != 0 {
		return 0, errno
	}
	if !room(out, entryOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.entry = gofuse.EntryOut{}
	return q.entryReply(q.s.fs.Mkdir(a, q.group, name, &q.o.entry))
}

func (q *Queue) doUnlink(in *bufvec.Vec) (int, syscall.Errno) {
	name, errno := q.restName(in)
	if errno != 0 {
		return 0, errno
	}
	if q.h.Opcode == OpRmdir {
		return 0, q.s.fs.Rmdir(&q.h, name)
	}
	return 0, q.s.fs.Unlink(&q.h, name)
}

func (q *Queue) doRename(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.rename
	size := uintptr(renameInSize)
	if q.h.Opcode == OpRename2 {
		size = rename2InSize
	}
	if errno := q.readArgs(in, unsafe.Pointer(a), size, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	b, errno := q.rest(in)
	if errno != 0 {
		return 0, errno
	}
	oldName, newName, errno := twoNames(b)
	if errno != 0 {
		return 0, errno
	}
	return 0, q.s.fs.Rename(&q.h, a.Newdir, a.Flags, oldName, newName)
}

func (q *Queue) doLink(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.link
	if errno := q.readArgs(in, unsafe.Pointer(a), linkInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	name, errno := q.restName(in)
	if errno != 0 {
		return 0, errno
	}
	if !room(out, entryOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.entry = gofuse.EntryOut{}
	return q.entryReply(q.s.fs.Link(a, name, &q.o.entry))
}

func (q *Queue) doOpen(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.open
	if errno := q.readArgs(in, unsafe.Pointer(a), openInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, openOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.open = gofuse.OpenOut{}
	var errno syscall.Errno
	if q.h.Opcode == OpOpendir {
		errno = q.s.fs.OpenDir(a, &q.o.open)
	} else {
		errno = q.s.fs.Open(a, &q.o.open)
	}
	if errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.open), openOutSize), 0
}

func (q *Queue) doCreate(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.create
	if errno := q.readArgs(in, unsafe.Pointer(a), createInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	tmpfile := q.h.Opcode == OpTmpfile
	var name []byte
	// TMPFILE carries the name of the kernel's placeholder dentry ("/"),
	// which means nothing to the file system; it may be absent.
	if !tmpfile || in.Len() > 0 {
		var errno syscall.Errno
		if name, errno = q.restName(in); errno != 0 {
			return 0, errno
		}
	}
	if !room(out, createOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.create = gofuse.CreateOut{}
	var errno syscall.Errno
	if tmpfile {
		errno = q.s.fs.Tmpfile(a, q.group, &q.o.create)
	} else {
		errno = q.s.fs.Create(a, q.group, name, &q.o.create)
	}
	if errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.create), createOutSize), 0
}

func (q *Queue) doFlush(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.flush
	if errno := q.readArgs(in, unsafe.Pointer(a), flushInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	return 0, q.s.fs.Flush(a)
}

func (q *Queue) doRelease(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.release
	if errno := q.readArgs(in, unsafe.Pointer(a), releaseInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if q.h.Opcode == OpReleasedir {
		q.s.fs.ReleaseDir(a)
	} else {
		q.s.fs.Release(a)
	}
	return 0, 0
}

func (q *Queue) doFsync(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.fsync
	if errno := q.readArgs(in, unsafe.Pointer(a), fsyncInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if q.h.Opcode == OpFsyncdir {
		return 0, q.s.fs.FsyncDir(a)
	}
	return 0, q.s.fs.Fsync(a)
}

func (q *Queue) doStatfs(out *bufvec.Vec) (int, syscall.Errno) {
	if !room(out, statfsOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.statfs = gofuse.StatfsOut{}
	if errno := q.s.fs.StatFs(&q.h, &q.o.statfs); errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.statfs), statfsOutSize), 0
}

func (q *Queue) doAccess(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.access
	if errno := q.readArgs(in, unsafe.Pointer(a), accessInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	return 0, q.s.fs.Access(a)
}

func (q *Queue) doSetxattr(in *bufvec.Vec, sess *session) (int, syscall.Errno) {
	a := &q.a.setxattr
	size := uintptr(setxattrInSize)
	if sess.caps&gofuse.CAP_SETXATTR_EXT != 0 {
		size = setxattrExtSize
	}
	if errno := q.readArgs(in, unsafe.Pointer(a), size, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	b, errno := q.rest(in)
	if errno != 0 {
		return 0, errno
	}
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return 0, syscall.EINVAL
	}
	name, value := b[:i], b[i+1:]
	if uint64(len(value)) != uint64(a.Size) {
		return 0, syscall.EINVAL
	}
	return 0, q.s.fs.SetXAttr(a, name, value)
}

// doGetxattr serves GETXATTR and LISTXATTR.
func (q *Queue) doGetxattr(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.getxattr
	if errno := q.readArgs(in, unsafe.Pointer(a), getxattrInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	list := q.h.Opcode == OpListxattr
	var name []byte
	if !list {
		var errno syscall.Errno
		if name, errno = q.restName(in); errno != 0 {
			return 0, errno
		}
	}
	call := func(dst []byte) (int, syscall.Errno) {
		if list {
			return q.s.fs.ListXAttr(&q.h, dst)
		}
		return q.s.fs.GetXAttr(&q.h, name, dst)
	}
	if a.Size == 0 {
		// The guest asks for the size: fuse_getxattr_out.
		if !room(out, getxattrOutSize) {
			return 0, syscall.EINVAL
		}
		n, errno := call(nil)
		if errno != 0 {
			return 0, errno
		}
		if n < 0 || uint64(n) > 1<<32-1 {
			return 0, syscall.EIO
		}
		p := q.payload(getxattrOutSize)
		binary.LittleEndian.PutUint32(p[0:], uint32(n))
		binary.LittleEndian.PutUint32(p[4:], 0)
		return getxattrOutSize, 0
	}
	avail := min(int(a.Size), out.Size()-OutHeaderSize, maxXattrReply)
	if avail == 0 {
		return 0, syscall.ERANGE
	}
	if err := out.Seek(OutHeaderSize); err != nil {
		return 0, syscall.EINVAL
	}
	// Fill the guest's buffer in place when it is one mapped run.
	dst, inPlace := out.Contiguous(avail)
	if !inPlace {
		dst = q.replyScratch(avail)
	}
	n, errno := call(dst)
	if errno != 0 {
		return 0, errno
	}
	if n < 0 || n > avail {
		return 0, syscall.EIO
	}
	if inPlace {
		q.direct = true
		return n, 0
	}
	return q.writeDirect(out, dst[:n])
}

func (q *Queue) doRemovexattr(in *bufvec.Vec) (int, syscall.Errno) {
	name, errno := q.restName(in)
	if errno != 0 {
		return 0, errno
	}
	return 0, q.s.fs.RemoveXAttr(&q.h, name)
}

func (q *Queue) doFallocate(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.falloc
	if errno := q.readArgs(in, unsafe.Pointer(a), fallocInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	return 0, q.s.fs.Fallocate(a)
}

func (q *Queue) doLseek(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.lseek
	if errno := q.readArgs(in, unsafe.Pointer(a), lseekInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, lseekOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.lseek = gofuse.LseekOut{}
	if errno := q.s.fs.Lseek(a, &q.o.lseek); errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.lseek), lseekOutSize), 0
}

func (q *Queue) doCopyFileRange(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.copy
	if errno := q.readArgs(in, unsafe.Pointer(a), copyInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, writeOutSize) {
		return 0, syscall.EINVAL
	}
	n, errno := q.s.fs.CopyFileRange(a)
	if errno != 0 {
		return 0, errno
	}
	p := q.payload(writeOutSize)
	binary.LittleEndian.PutUint32(p[0:], n)
	binary.LittleEndian.PutUint32(p[4:], 0)
	return writeOutSize, 0
}

func (q *Queue) doSyncfs(in *bufvec.Vec) (int, syscall.Errno) {
	// fuse_syncfs_in is 8 bytes of padding.
	if err := in.Skip(8); err != nil {
		return 0, syscall.EINVAL
	}
	return 0, q.s.fs.SyncFs(&q.h)
}

func (q *Queue) doStatx(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.statx
	if errno := q.readArgs(in, unsafe.Pointer(a), statxInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, statxOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.statx = gofuse.StatxOut{}
	if errno := q.s.fs.Statx(a, &q.o.statx); errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.statx), statxOutSize), 0
}

func (q *Queue) doGetlk(in, out *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.lk
	if errno := q.readArgs(in, unsafe.Pointer(a), lkInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	if !room(out, lkOutSize) {
		return 0, syscall.EINVAL
	}
	q.o.lk = gofuse.LkOut{}
	if errno := q.s.fs.GetLk(a, &q.o.lk); errno != 0 {
		return 0, errno
	}
	return q.put(unsafe.Pointer(&q.o.lk), lkOutSize), 0
}

func (q *Queue) doSetlk(in *bufvec.Vec) (int, syscall.Errno) {
	a := &q.a.lk
	if errno := q.readArgs(in, unsafe.Pointer(a), lkInSize, unsafe.Sizeof(*a)); errno != 0 {
		return 0, errno
	}
	return 0, q.s.fs.SetLk(a, q.h.Opcode == OpSetlkw)
}
