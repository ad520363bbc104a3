package fuse

import (
	"encoding/binary"
	"syscall"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Directory entry encoding (fuse_dirent, fuse_direntplus).
const (
	direntSize     = 24                        // ino, off, namelen, type
	direntPlusSize = entryOutSize + direntSize // fuse_entry_out then fuse_dirent
	maxDirName     = 1024                      // FUSE_NAME_MAX
)

// dirEncoder writes READDIR and READDIRPLUS replies straight into the reply
// segments as the file system emits entries. One lives in each Queue.
type dirEncoder struct {
	q    *Queue
	emit func(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool)

	out     *bufvec.Vec
	plus    bool
	limit   int // bytes the reply may hold after the out header
	used    int // bytes reserved, including a pending record
	written int // bytes written into out
	err     syscall.Errno

	// A READDIRPLUS record is written once the file system has filled
	// in its entry, at the next emit or when ReadDir returns.
	pending    bool
	pendingLen int
	entry      gofuse.EntryOut
	drop       uint64 // node id whose reference could not be delivered

	rec [direntPlusSize + maxDirName + 8]byte
}

func (e *dirEncoder) init(q *Queue) {
	e.q = q
	e.emit = e.add // bound once: no allocation per request
}

func align8(n int) int { return (n + 7) &^ 7 }

// dtype converts the file system's S_IFMT bits into a DT_* value; small
// values are taken as DT_* already.
func dtype(typ uint32) uint32 {
	if typ > 15 {
		return (typ & syscall.S_IFMT) >> 12
	}
	return typ
}

func (e *dirEncoder) add(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool) {
	if e.err != 0 {
		return nil, false
	}
	e.flush()
	if e.err != 0 {
		return nil, false
	}
	if len(name) == 0 || len(name) > maxDirName {
		// The guest would reject the whole reply.
		e.err = syscall.EIO
		return nil, false
	}
	base := 0
	if e.plus {
		base = entryOutSize
	}
	reclen := align8(base + direntSize + len(name))
	if e.used+reclen > e.limit {
		return nil, false
	}
	d := e.rec[base:reclen]
	binary.LittleEndian.PutUint64(d[0:], ino)
	binary.LittleEndian.PutUint64(d[8:], off)
	binary.LittleEndian.PutUint32(d[16:], uint32(len(name)))
	binary.LittleEndian.PutUint32(d[20:], dtype(typ))
	n := copy(d[direntSize:], name)
	clear(d[direntSize+n:])
	e.used += reclen
	if e.plus {
		e.pending = true
		e.pendingLen = reclen
		e.entry = gofuse.EntryOut{}
		return &e.entry, true
	}
	if !e.write(reclen) {
		return nil, false
	}
	return nil, true
}

// flush writes the pending READDIRPLUS record.
func (e *dirEncoder) flush() {
	if !e.pending {
		return
	}
	e.pending = false
	copy(e.rec[:entryOutSize], unsafe.Slice((*byte)(unsafe.Pointer(&e.entry)), entryOutSize))
	if !e.write(e.pendingLen) && e.entry.NodeId != 0 {
		e.drop = e.entry.NodeId
	}
}

func (e *dirEncoder) write(reclen int) bool {
	if err := e.out.WriteFull(e.rec[:reclen]); err != nil {
		e.err = argErr(err)
		e.used -= reclen
		return false
	}
	e.written += reclen
	return true
}

// doReaddir serves READDIR and READDIRPLUS.
func (q *Queue) doReaddir(_, out *bufvec.Vec) syscall.Errno {
	a := argsOf[gofuse.ReadIn](q)
	if err := out.Seek(OutHeaderSize); err != nil {
		return syscall.EINVAL
	}
	e := &q.rd
	e.out = out
	e.plus = q.req.Opcode == OpReaddirplus
	e.limit = int(min(uint64(a.Size), uint64(out.Len())))
	e.used, e.written, e.err, e.pending, e.drop = 0, 0, 0, false, 0
	errno := q.s.fs.ReadDir(a, e.plus, e.emit)
	e.flush()
	e.out = nil
	if e.drop != 0 {
		// The entry's lookup reference never reached the guest.
		q.s.fs.Forget(e.drop, 1)
	}
	if e.written == 0 {
		if errno != 0 {
			return errno
		}
		if e.err != 0 {
			return e.err
		}
	}
	// Entries already encoded are delivered even if listing stopped
	// with an error: their lookup references are the guest's now.
	q.n, q.direct = e.written, true
	return 0
}
