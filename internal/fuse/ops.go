package fuse

import (
	"encoding/binary"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// The handlers of the opcodes (the table in opcode.go). When one runs,
// decode has read the request: q.req holds its fixed arguments (read
// with argsOf), q.name and q.name2 its names, in's cursor is past them. A
// fixed reply payload (the entry's out) is zeroed, and room for it checked:
// the file system fills it in place (replyOf). A handler whose reply has no
// fixed size sets q.n itself, and q.direct when it wrote the payload
// straight into out after the out header.

func (q *Queue) doLookup(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Lookup(&q.req.InHeader, q.name, replyOf[gofuse.EntryOut](q))
}

func (q *Queue) doForget(_, _ *bufvec.Vec) syscall.Errno {
	a := argsOf[gofuse.ForgetIn](q)
	q.s.fs.Forget(a.NodeId, a.Nlookup)
	return 0
}

func (q *Queue) doBatchForget(in, _ *bufvec.Vec) syscall.Errno {
	count := min(uint64(binary.LittleEndian.Uint32(q.req.args[:])), uint64(in.Len()/forgetOneSize))
	for range count {
		if in.ReadFull(q.forget[:]) != nil {
			break
		}
		q.s.fs.Forget(binary.LittleEndian.Uint64(q.forget[0:]), binary.LittleEndian.Uint64(q.forget[8:]))
	}
	return 0
}

func (q *Queue) doGetattr(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.GetAttr(argsOf[gofuse.GetAttrIn](q), replyOf[gofuse.AttrOut](q))
}

func (q *Queue) doSetattr(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.SetAttr(argsOf[gofuse.SetAttrIn](q), replyOf[gofuse.AttrOut](q))
}

func (q *Queue) doReadlink(_, out *bufvec.Vec) syscall.Errno {
	buf := q.replyScratch(maxLink)
	n, errno := q.s.fs.Readlink(&q.req.InHeader, buf)
	if errno != 0 {
		return errno
	}
	if n < 0 || n > len(buf) {
		return syscall.EIO
	}
	if !room(out, n) {
		return syscall.ENAMETOOLONG
	}
	return q.writeDirect(out, buf[:n])
}

// writeDirect writes a variable-length payload straight into out.
func (q *Queue) writeDirect(out *bufvec.Vec, p []byte) syscall.Errno {
	if err := out.Seek(OutHeaderSize); err != nil {
		return syscall.EINVAL
	}
	if err := out.WriteFull(p); err != nil {
		return argErr(err)
	}
	q.n, q.direct = len(p), true
	return 0
}

// replyScratch returns a scratch buffer of n bytes for a reply that is
// built before it is copied into out.
func (q *Queue) replyScratch(n int) []byte {
	if cap(q.dbuf) < n {
		q.dbuf = make([]byte, max(n, maxLink)) // at most twice per queue
	}
	return q.dbuf[:n]
}

func (q *Queue) doSymlink(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Symlink(&q.req.InHeader, q.groups, q.secctx, q.name2, q.name, replyOf[gofuse.EntryOut](q))
}

func (q *Queue) doMknod(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Mknod(argsOf[gofuse.MknodIn](q), q.groups, q.secctx, q.name, replyOf[gofuse.EntryOut](q))
}

func (q *Queue) doMkdir(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Mkdir(argsOf[gofuse.MkdirIn](q), q.groups, q.secctx, q.name, replyOf[gofuse.EntryOut](q))
}

func (q *Queue) doUnlink(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Unlink(&q.req.InHeader, q.name)
}

func (q *Queue) doRmdir(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Rmdir(&q.req.InHeader, q.name)
}

func (q *Queue) doRename(_, _ *bufvec.Vec) syscall.Errno {
	a := argsOf[gofuse.RenameIn](q)
	return q.s.fs.Rename(&q.req.InHeader, a.Newdir, a.Flags, q.name, q.name2)
}

func (q *Queue) doLink(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Link(argsOf[gofuse.LinkIn](q), q.name, replyOf[gofuse.EntryOut](q))
}

func (q *Queue) doOpen(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Open(argsOf[gofuse.OpenIn](q), replyOf[gofuse.OpenOut](q))
}

func (q *Queue) doOpendir(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.OpenDir(argsOf[gofuse.OpenIn](q), replyOf[gofuse.OpenOut](q))
}

func (q *Queue) doCreate(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Create(argsOf[gofuse.CreateIn](q), q.groups, q.secctx, q.name, replyOf[gofuse.CreateOut](q))
}

func (q *Queue) doTmpfile(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Tmpfile(argsOf[gofuse.CreateIn](q), q.groups, q.secctx, replyOf[gofuse.CreateOut](q))
}

func (q *Queue) doRead(_, out *bufvec.Vec) syscall.Errno {
	a := argsOf[gofuse.ReadIn](q)
	if err := out.Seek(OutHeaderSize); err != nil {
		return syscall.EINVAL
	}
	// The guest offers room for what it asked; never read more than the
	// room there is.
	if uint64(a.Size) > uint64(out.Len()) {
		a.Size = uint32(out.Len())
	}
	n, errno := q.s.fs.Read(a, out)
	if errno != 0 {
		return errno
	}
	if n < 0 || n > int(a.Size) {
		return syscall.EIO
	}
	q.n, q.direct = n, true
	return 0
}

func (q *Queue) doWrite(in, _ *bufvec.Vec) syscall.Errno {
	a := argsOf[gofuse.WriteIn](q)
	// The session's max_write: the one INIT told the guest, which a
	// migrated session keeps whatever this daemon's options say.
	if int(a.Size) != in.Len() || a.Size > q.sess.maxWrite {
		return syscall.EINVAL
	}
	n, errno := q.s.fs.Write(a, in)
	if errno != 0 {
		return errno
	}
	if n < 0 || n > int(a.Size) {
		return syscall.EIO
	}
	replyOf[gofuse.WriteOut](q).Size = uint32(n)
	return 0
}

func (q *Queue) doFlush(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Flush(argsOf[gofuse.FlushIn](q))
}

func (q *Queue) doRelease(_, _ *bufvec.Vec) syscall.Errno {
	q.s.fs.Release(argsOf[gofuse.ReleaseIn](q))
	return 0
}

func (q *Queue) doReleasedir(_, _ *bufvec.Vec) syscall.Errno {
	q.s.fs.ReleaseDir(argsOf[gofuse.ReleaseIn](q))
	return 0
}

func (q *Queue) doFsync(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Fsync(argsOf[gofuse.FsyncIn](q))
}

func (q *Queue) doFsyncdir(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.FsyncDir(argsOf[gofuse.FsyncIn](q))
}

func (q *Queue) doStatfs(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.StatFs(&q.req.InHeader, replyOf[gofuse.StatfsOut](q))
}

func (q *Queue) doAccess(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Access(argsOf[gofuse.AccessIn](q))
}

func (q *Queue) doSetxattr(_, _ *bufvec.Vec) syscall.Errno {
	a := argsOf[gofuse.SetXAttrIn](q)
	if uint64(len(q.name2)) != uint64(a.Size) {
		return syscall.EINVAL
	}
	return q.s.fs.SetXAttr(a, q.name, q.name2)
}

// doGetxattr serves GETXATTR and LISTXATTR.
func (q *Queue) doGetxattr(_, out *bufvec.Vec) syscall.Errno {
	list := q.req.Opcode == OpListxattr
	call := func(dst []byte) (int, syscall.Errno) {
		if list {
			return q.s.fs.ListXAttr(&q.req.InHeader, dst)
		}
		return q.s.fs.GetXAttr(&q.req.InHeader, q.name, dst)
	}
	size := argsOf[gofuse.GetXAttrIn](q).Size
	if size == 0 {
		// The guest asks for the size: fuse_getxattr_out.
		if !room(out, getxattrOutSize) {
			return syscall.EINVAL
		}
		n, errno := call(nil)
		if errno != 0 {
			return errno
		}
		if n < 0 || uint64(n) > 1<<32-1 {
			return syscall.EIO
		}
		*replyOf[gofuse.GetXAttrOut](q) = gofuse.GetXAttrOut{Size: uint32(n)}
		q.n = getxattrOutSize
		return 0
	}
	avail := min(int(size), out.Size()-OutHeaderSize, maxXattrReply)
	if avail == 0 {
		return syscall.ERANGE
	}
	if err := out.Seek(OutHeaderSize); err != nil {
		return syscall.EINVAL
	}
	// Fill the guest's buffer in place when it is one mapped run.
	dst, inPlace := out.Contiguous(avail)
	if !inPlace {
		dst = q.replyScratch(avail)
	}
	n, errno := call(dst)
	if errno != 0 {
		return errno
	}
	if n < 0 || n > avail {
		return syscall.EIO
	}
	if inPlace {
		q.n, q.direct = n, true
		return 0
	}
	return q.writeDirect(out, dst[:n])
}

func (q *Queue) doRemovexattr(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.RemoveXAttr(&q.req.InHeader, q.name)
}

func (q *Queue) doFallocate(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Fallocate(argsOf[gofuse.FallocateIn](q))
}

func (q *Queue) doLseek(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Lseek(argsOf[gofuse.LseekIn](q), replyOf[gofuse.LseekOut](q))
}

// MaxCopy32 is the most one COPY_FILE_RANGE copies: its reply counts in 32
// bits. It is what Linux clamps the length to when it sends one after
// COPY_FILE_RANGE_64 failed (the largest page-aligned u32); an older guest
// may ask for more, and gets a short copy, which copy_file_range allows.
const MaxCopy32 = 0xfffff000

func (q *Queue) doCopyFileRange(_, _ *bufvec.Vec) syscall.Errno {
	n, errno := q.s.fs.CopyFileRange(argsOf[gofuse.CopyFileRangeIn](q), MaxCopy32)
	replyOf[gofuse.WriteOut](q).Size = uint32(min(n, MaxCopy32))
	return errno
}

// copyOut64 is fuse_copy_file_range_out.
type copyOut64 struct{ BytesCopied uint64 }

func (q *Queue) doCopyFileRange64(_, _ *bufvec.Vec) syscall.Errno {
	n, errno := q.s.fs.CopyFileRange(argsOf[gofuse.CopyFileRangeIn](q), ^uint64(0))
	replyOf[copyOut64](q).BytesCopied = n
	return errno
}

func (q *Queue) doSyncfs(in, _ *bufvec.Vec) syscall.Errno {
	if err := in.Skip(8); err != nil {
		return syscall.EINVAL
	}
	return q.s.fs.SyncFs(&q.req.InHeader)
}

func (q *Queue) doStatx(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.Statx(argsOf[gofuse.StatxIn](q), replyOf[gofuse.StatxOut](q))
}

func (q *Queue) doGetlk(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.GetLk(argsOf[gofuse.LkIn](q), replyOf[gofuse.LkOut](q))
}

func (q *Queue) doSetlk(_, _ *bufvec.Vec) syscall.Errno {
	return q.s.fs.SetLk(argsOf[gofuse.LkIn](q), q.req.Opcode == OpSetlkw)
}
