package fuse

import (
	"encoding/binary"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// DAX: FUSE_SETUPMAPPING and FUSE_REMOVEMAPPING map pieces of files into
// the device's shared-memory window (the VMM's, through vhost-user
// SHMEM_MAP) and out of it. The server negotiates them only with a window
// (a FileSystem that is a Windowed with a size above 0) and checks every
// value the guest sends before the file system sees it; the file system
// does the file work (passthrough: open the node's file, tails, the
// window's messages).
//
// What the server refuses, and with which errno (the file system adds its
// own: unknown node EBADF, ...):
//
//	no window (size 0)                                   ENOSYS (both opcodes)
//	request shorter than its fixed arguments             EINVAL
//	SETUPMAPPING flags other than READ|WRITE             EINVAL
//	len == 0                                             EINVAL
//	moffset or len not a multiple of 4096 (map_align 12) EINVAL
//	foffset not a multiple of 4096                       EINVAL
//	moffset+len overflows or passes the window's end     EINVAL
//	foffset+len overflows or passes 2^63 (an off_t)      EFBIG
//	REMOVEMAPPING count == 0                             EINVAL
//	count > MaxRemoveMappings (PAGE_SIZE/16 = 256)       EINVAL
//	count entries longer than what the request holds     EINVAL
//	an entry failing the moffset/len checks above        EINVAL, no entry removed
//
// A REMOVEMAPPING is checked whole, then reaches the file system as one
// RemoveMapping call with all its entries: the file system, too, refuses
// the request whole (an entry that cuts through a mapping) or removes
// every entry.

// MapRange is one entry of a REMOVEMAPPING: a range of the window. The
// same unnamed struct type as passthrough's, which does not import this
// package.
type MapRange = struct{ Moffset, Len uint64 }

// Windowed is a FileSystem that offers a DAX window. The server asks at
// each INIT (the window may be wired after the server was made): a size
// of 0 means none, and SETUPMAPPING and REMOVEMAPPING are then ENOSYS.
type Windowed interface {
	WindowSize() uint64
}

// The wire layout of the two opcodes.
const (
	setupMappingInSize  = 40 // fuse_setupmapping_in {fh, foffset, len, flags, moffset}
	removeMappingInSize = 4  // fuse_removemapping_in {count}
	removeMappingOne    = 16 // fuse_removemapping_one {moffset, len}

	// SetupMappingWrite and SetupMappingRead are fuse_setupmapping_in's
	// flags.
	SetupMappingWrite = 1 << 0
	SetupMappingRead  = 1 << 1

	// MapAlignment is the log2 of the alignment the server asks of
	// moffset, foffset and len (INIT's map_alignment): the page.
	MapAlignment = 12
	mapAlign     = 1 << MapAlignment

	// MaxRemoveMappings bounds REMOVEMAPPING's count: Linux sends at
	// most PAGE_SIZE / sizeof(fuse_removemapping_one) per request.
	MaxRemoveMappings = 4096 / removeMappingOne

	// daxCaps are INIT's DAX flags, negotiated only with a window.
	daxCaps = gofuse.CAP_MAP_ALIGNMENT | gofuse.CAP_HAS_INODE_DAX
)

// SetupMappingIn is fuse_setupmapping_in.
type SetupMappingIn struct {
	Fh, Foffset, Len, Flags, Moffset uint64
}

// decodeSetupMapping reads fuse_setupmapping_in from the fixed arguments
// and checks it against a window of window bytes.
func decodeSetupMapping(args []byte, window uint64) (SetupMappingIn, syscall.Errno) {
	var a SetupMappingIn
	if len(args) < setupMappingInSize {
		return a, syscall.EINVAL
	}
	le := binary.LittleEndian
	a = SetupMappingIn{Fh: le.Uint64(args[0:]), Foffset: le.Uint64(args[8:]), Len: le.Uint64(args[16:]),
		Flags: le.Uint64(args[24:]), Moffset: le.Uint64(args[32:])}
	if a.Flags&^(SetupMappingRead|SetupMappingWrite) != 0 {
		return a, syscall.EINVAL
	}
	if errno := checkWindowRange(a.Moffset, a.Len, window); errno != 0 {
		return a, errno
	}
	if a.Foffset%mapAlign != 0 {
		return a, syscall.EINVAL
	}
	if a.Foffset > 1<<63-a.Len {
		return a, syscall.EFBIG
	}
	return a, 0
}

// checkWindowRange checks a range of the window: page-aligned, not empty,
// inside a window of window bytes.
func checkWindowRange(moffset, length, window uint64) syscall.Errno {
	switch {
	case length == 0, length%mapAlign != 0, moffset%mapAlign != 0:
		return syscall.EINVAL
	case moffset > window || length > window-moffset:
		return syscall.EINVAL
	}
	return 0
}

// decodeRemoveMapping checks a REMOVEMAPPING's count against its bound and
// against the entries the request holds (entries: the bytes after
// fuse_removemapping_in), then every entry, decoding them into ranges
// (which has room for MaxRemoveMappings); it returns how many.
func decodeRemoveMapping(count uint32, entries []byte, window uint64, ranges []MapRange) (int, syscall.Errno) {
	if count == 0 || count > MaxRemoveMappings || uint64(count)*removeMappingOne > uint64(len(entries)) {
		return 0, syscall.EINVAL
	}
	for k := range int(count) {
		e := entries[k*removeMappingOne:]
		r := MapRange{Moffset: binary.LittleEndian.Uint64(e), Len: binary.LittleEndian.Uint64(e[8:])}
		if errno := checkWindowRange(r.Moffset, r.Len, window); errno != 0 {
			return 0, errno
		}
		ranges[k] = r
	}
	return int(count), 0
}

func (q *Queue) doSetupMapping(_, _ *bufvec.Vec) syscall.Errno {
	a, errno := decodeSetupMapping(q.req.args[:setupMappingInSize], q.sess.window)
	if errno != 0 {
		return errno
	}
	return q.s.fs.SetupMapping(&q.req.InHeader, a.Fh, a.Foffset, a.Len, a.Flags, a.Moffset)
}

func (q *Queue) doRemoveMapping(in, _ *bufvec.Vec) syscall.Errno {
	count := binary.LittleEndian.Uint32(q.req.args[:])
	// Copied whole before any check: the guest cannot change an entry
	// between its check and its use.
	n := min(in.Len(), MaxRemoveMappings*removeMappingOne)
	if uint64(count)*removeMappingOne > uint64(n) {
		return syscall.EINVAL
	}
	b := q.replyScratch(n)
	if err := in.ReadFull(b); err != nil {
		return argErr(err)
	}
	if q.ranges == nil {
		q.ranges = new([MaxRemoveMappings]MapRange) // once per queue, and only with DAX
	}
	n, errno := decodeRemoveMapping(count, b, q.sess.window, q.ranges[:])
	if errno != 0 {
		return errno
	}
	return q.s.fs.RemoveMapping(q.ranges[:n])
}

// windowSize asks the file system for its window's size (0: none).
func (s *Server) windowSize() uint64 {
	if w, ok := s.fs.(Windowed); ok {
		return w.WindowSize()
	}
	return 0
}
