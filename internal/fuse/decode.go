package fuse

import (
	"bytes"
	"errors"
	"syscall"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
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

// request is the fixed part of the request being served: its header, then
// its opcode's arguments, laid out so that it reads as the go-fuse struct
// of those arguments (each begins with the InHeader).
type request struct {
	gofuse.InHeader
	args [setattrInSize]byte // the largest
}

// argsOf returns the request as go-fuse's T (ReadIn, GetAttrIn...): the
// struct of the opcode's arguments, which request holds.
func argsOf[T any](q *Queue) *T { return (*T)(unsafe.Pointer(&q.req)) }

// replyOf returns the reply payload as go-fuse's T (AttrOut, EntryOut...),
// which the file system fills in place.
func replyOf[T any](q *Queue) *T { return (*T)(unsafe.Pointer(&q.rbuf[OutHeaderSize])) }

// readArgs reads the next n bytes of the request into the arguments after
// the header, the rest zeroed: the fields a shorter, older layout of a
// struct lacks read as zero.
func (q *Queue) readArgs(in *bufvec.Vec, n int) syscall.Errno {
	q.req.args = [len(q.req.args)]byte{} // a few stores, where clear(args[n:]) is a call
	if err := in.ReadFull(q.req.args[:n]); err != nil {
		return argErr(err)
	}
	return 0
}

// initIn: fuse_init_in is 16 bytes before 7.36 and 64 from then on; the
// request's length tells which.
func initIn(_ *Queue, in *bufvec.Vec) int { return max(initInOldSize, min(in.Len(), initInSize)) }

// setxattrIn: fuse_setxattr_in is 16 bytes with FUSE_SETXATTR_EXT, 8
// without.
func setxattrIn(q *Queue, _ *bufvec.Vec) int {
	if q.sess.caps&gofuse.CAP_SETXATTR_EXT != 0 {
		return setxattrExtSize
	}
	return setxattrInSize
}

// readNames decodes what follows the fixed arguments, as layout says, into
// q.name and q.name2.
func (q *Queue) readNames(in *bufvec.Vec, layout nameLayout) syscall.Errno {
	q.name, q.name2 = nil, nil
	if layout == maybeName && in.Len() == 0 {
		return 0
	}
	b, errno := q.rest(in)
	if errno != 0 {
		return errno
	}
	if layout == oneName || layout == maybeName {
		q.name, errno = nameIn(b)
		return errno
	}
	// A name and its NUL, then a second name or a value.
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return syscall.EINVAL
	}
	q.name, q.name2 = b[:i], b[i+1:]
	if layout == twoNames {
		q.name2, errno = nameIn(q.name2)
	}
	return errno
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

// nameIn returns the name in b, which must be the name followed by its
// terminating NUL and nothing else.
func nameIn(b []byte) ([]byte, syscall.Errno) {
	if len(b) == 0 || b[len(b)-1] != 0 {
		return nil, syscall.EINVAL
	}
	name := b[:len(b)-1]
	if bytes.IndexByte(name, 0) >= 0 {
		return nil, syscall.EINVAL
	}
	return name, 0
}

// room reports whether the writable part can hold a reply of n payload
// bytes.
func room(out *bufvec.Vec, n int) bool { return out.Size() >= OutHeaderSize+n }
