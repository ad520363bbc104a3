package fuse

import (
	"encoding/binary"
	"syscall"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Request extensions (protocol 7.38): the last total_extlen*8 bytes of a
// request, after its arguments and names, are a sequence of
//
//	fuse_ext_header { u32 size; u32 type }   size counts the header, a multiple of 8
//	then size-8 bytes of the extension
//
// Linux sends one only with creation requests (CREATE, MKNOD, MKDIR,
// SYMLINK, TMPFILE): FUSE_EXT_GROUPS (type 32) when CREATE_SUPP_GROUP is
// negotiated and the caller may write to the parent directory only through
// a supplementary group, { u32 nr_groups = 1; u32 groups[1] }; a security
// context (types 0..31, their count: secctx.go) with SECURITY_CTX, refused
// in a session that did not negotiate it.
const (
	extHeaderSize = 8
	extGroups     = 32
)

// extensions checks the extension area of the request in q.req, records a
// supplementary group in q.group, and cuts the area off in, so that the
// argument decoders see the request as without extensions. An area that is
// malformed or holds an extension type this server does not know is EINVAL:
// an unknown extension may change the request's meaning.
func (q *Queue) extensions(in *bufvec.Vec) syscall.Errno {
	end := in.Size()
	n := int(q.req.TotalExtlen) * 8
	if n > end-InHeaderSize {
		return syscall.EINVAL
	}
	start := end - n
	if err := in.Seek(start); err != nil {
		return argErr(err)
	}
	q.secSeen = false
	var b [16]byte
	for pos := start; pos < end; {
		if err := in.ReadFull(b[:extHeaderSize]); err != nil {
			return argErr(err)
		}
		size := int(binary.LittleEndian.Uint32(b[0:]))
		typ := binary.LittleEndian.Uint32(b[4:])
		if size < extHeaderSize || size%8 != 0 || size > end-pos {
			return syscall.EINVAL
		}
		switch typ {
		case extGroups:
			// The kernel sends exactly one group (fs/fuse/dir.c,
			// get_create_supp_group); more would leave us to guess
			// which one the permission came through.
			if size < extHeaderSize+8 || q.group != NoGroup {
				return syscall.EINVAL
			}
			if err := in.ReadFull(b[8:16]); err != nil {
				return argErr(err)
			}
			nr, g := binary.LittleEndian.Uint32(b[8:]), binary.LittleEndian.Uint32(b[12:])
			if nr != 1 || g == NoGroup {
				return syscall.EINVAL
			}
			q.group = g
		default:
			if errno := q.secCtxExt(in, typ, size-extHeaderSize); errno != 0 {
				return errno
			}
		}
		pos += size
		if err := in.Seek(pos); err != nil {
			return argErr(err)
		}
	}
	if in.Seek(InHeaderSize) != nil || in.Truncate(start) != nil {
		return syscall.EINVAL
	}
	return 0
}
