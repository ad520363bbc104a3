package fuse

import (
	"bytes"
	"errors"
	"syscall"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Sizes of the argument structs after fuse_in_header, as the kernel sends
// them to a client of minor >= 27.
const (
	forgetInSize    = 8
	getattrInSize   = 16
	setattrInSize   = 88
	mknodInSize     = 16
	mkdirInSize     = 8
	renameInSize    = 8  // fuse_rename_in (RENAME)
	rename2InSize   = 16 // fuse_rename2_in (RENAME2)
	linkInSize      = 8
	openInSize      = 8
	createInSize    = 16
	readInSize      = 40
	writeInSize     = 40
	releaseInSize   = 24
	fsyncInSize     = 16
	flushInSize     = 24
	setxattrInSize  = 8  // without FUSE_SETXATTR_EXT
	setxattrExtSize = 16 // with FUSE_SETXATTR_EXT
	getxattrInSize  = 8
	lkInSize        = 48
	accessInSize    = 8
	fallocInSize    = 32
	lseekInSize     = 24
	copyInSize      = 56
	statxInSize     = 24
	initInSize      = 64 // from 7.36; older clients send 16
	initInOldSize   = 16
	batchForgetSize = 8
	forgetOneSize   = 16
)

// Sizes of the reply payloads.
const (
	entryOutSize    = 128
	attrOutSize     = 104
	openOutSize     = 16
	createOutSize   = entryOutSize + openOutSize
	statfsOutSize   = 80
	writeOutSize    = 8
	getxattrOutSize = 8
	lkOutSize       = 24
	lseekOutSize    = 8
	statxOutSize    = 288
	initOutSize     = 64
)

// Limits on the variable parts of a request.
const (
	// maxNameRegion bounds the bytes after the fixed arguments that are
	// copied: SETXATTR's name (XATTR_NAME_MAX) and value
	// (XATTR_SIZE_MAX), or SYMLINK's name and target (PATH_MAX).
	maxNameRegion  = 256 + 65536
	initialNameBuf = 4096
	// maxXattrReply bounds GETXATTR and LISTXATTR replies
	// (XATTR_SIZE_MAX, XATTR_LIST_MAX).
	maxXattrReply = 65536
	// maxLink is the buffer READLINK gets (PATH_MAX).
	maxLink = 4096
)

// argErr maps a cursor error while decoding arguments to the reply errno:
// a request shorter than its arguments is EINVAL, arguments in memory the
// daemon has not mapped are EFAULT.
func argErr(err error) syscall.Errno {
	if errors.Is(err, bufvec.ErrUnmapped) {
		return syscall.EFAULT
	}
	return syscall.EINVAL
}

// readArgs fills the struct at p (an InHeader followed by argument fields,
// full bytes in all) with the request header and the next size argument
// bytes of the request; the rest of the struct is zeroed.
func (q *Queue) readArgs(in *bufvec.Vec, p unsafe.Pointer, size, full uintptr) syscall.Errno {
	b := unsafe.Slice((*byte)(p), full)
	*(*gofuse.InHeader)(p) = q.h
	clear(b[InHeaderSize:])
	if err := in.ReadFull(b[InHeaderSize : InHeaderSize+size]); err != nil {
		return argErr(err)
	}
	return 0
}

// rest copies the remainder of the request (names, SETXATTR's value) into
// the queue's scratch buffer. Names are always copied, never used in place:
// the guest could change its memory between the checks made on a name and
// the system call that uses it.
func (q *Queue) rest(in *bufvec.Vec) ([]byte, syscall.Errno) {
	n := in.Len()
	if n > maxNameRegion {
		return nil, syscall.EINVAL
	}
	if n > cap(q.names) {
		q.names = make([]byte, 0, maxNameRegion) // once per queue
	}
	b := q.names[:n]
	if err := in.ReadFull(b); err != nil {
		return nil, argErr(err)
	}
	return b, 0
}

// oneName returns the name in b, which must be the name followed by its
// terminating NUL and nothing else.
func oneName(b []byte) ([]byte, syscall.Errno) {
	if len(b) == 0 || b[len(b)-1] != 0 {
		return nil, syscall.EINVAL
	}
	name := b[:len(b)-1]
	if bytes.IndexByte(name, 0) >= 0 {
		return nil, syscall.EINVAL
	}
	return name, 0
}

// twoNames splits b into two NUL-terminated names that fill it exactly.
func twoNames(b []byte) ([]byte, []byte, syscall.Errno) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return nil, nil, syscall.EINVAL
	}
	second, errno := oneName(b[i+1:])
	if errno != 0 {
		return nil, nil, errno
	}
	return b[:i], second, 0
}

// restName reads the rest of the request as one NUL-terminated name.
func (q *Queue) restName(in *bufvec.Vec) ([]byte, syscall.Errno) {
	b, errno := q.rest(in)
	if errno != 0 {
		return nil, errno
	}
	return oneName(b)
}

// room reports whether the writable part can hold a reply of n payload
// bytes; handlers check it before calling the file system, so that an
// operation (e.g. one that takes a lookup reference) is not carried out
// when its answer could not be delivered.
func room(out *bufvec.Vec, n int) bool { return out.Size() >= OutHeaderSize+n }

// payload returns the small-reply buffer for n bytes after the out header.
func (q *Queue) payload(n int) []byte { return q.rbuf[OutHeaderSize : OutHeaderSize+n] }

// put copies the reply struct at p (n bytes) into the small-reply buffer.
func (q *Queue) put(p unsafe.Pointer, n int) int {
	copy(q.payload(n), unsafe.Slice((*byte)(p), n))
	return n
}
